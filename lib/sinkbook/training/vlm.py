"""A small vision-language model built like the real ones: a frozen vision encoder, a 2-layer MLP projector,
and a pretrained language model that reads the projected image tokens inside its prompt.

- ``DigitEncoder``: a small convolutional network trained here on the digit labels and then frozen (it stands in
  for CLIP / SigLIP). Each 8x8 digit becomes a 2x2 grid of patch features, so a row of k digits gives 4k image
  tokens, in reading order.
- ``Projector``: Linear -> GELU -> Linear into the language model's embedding space (LLaVA's projector).
- ``DigitVLM``: replaces the placeholder positions of the prompt's input embeddings by the projected patches and
  runs the language model on ``inputs_embeds``. The image sits inside the user turn (chat template when the
  tokenizer has one, a plain "Image: ... Question: ... Answer:" format otherwise), so position 0 is the text
  token it always was.
- The training loss is next-token cross-entropy on the answer tokens only, and the output head is applied only
  at those positions (``answer_loss``): with Gemma's 262k-token vocabulary, full logits would dominate the cost.

An adapted model is saved as a ``save_pretrained`` directory of the language model (``load_model`` reads it as a
plain causal LM: the text-only backbone, as the paper extracts it) plus ``sinkbook_vision.pt`` (encoder,
projector, prompt format); ``load_vlm`` restores the whole model.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from ..core.arch import head_logits
from ..core.models import LoadedModel, load_model, model_directory
from .digits import Example

IMAGE_MARKER = "<image>"
PATCHES_PER_DIGIT = 4
PLAIN_TEMPLATE = "Image: {image}\nQuestion: {question}\nAnswer:"
VISION_FILE = "sinkbook_vision.pt"


class DigitEncoder(nn.Module):
    """8x8 digit -> (4, width) patch features (a 2x2 grid); a linear head on their mean classifies the digit."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.width = width
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, width, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2))
        self.head = nn.Linear(width, 10)

    def patches(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 8, 8) -> (N, 4, width), patches in reading order."""
        features = self.body(images[:, None])                    # (N, width, 2, 2)
        return features.flatten(2).transpose(1, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.patches(images).mean(1))


def train_encoder(train_images: torch.Tensor, train_labels: torch.Tensor, seed: int = 0, epochs: int = 30,
                  width: int = 64) -> DigitEncoder:
    """Fit the encoder on the digit labels (Adam, mini-batches of 64), then freeze it.

    Trained on one thread whatever the caller's setting: CPU kernels sum in an order that depends on the thread
    count, and the weights after 30 epochs differed visibly between one and two threads (up to 0.14), enough to
    move the adapted models' scores; every run of every machine must read the same encoder."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        encoder = DigitEncoder(width)
        optimizer = torch.optim.Adam(encoder.parameters(), lr=3e-3)
        order = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            perm = torch.randperm(len(train_labels), generator=order)
            for start in range(0, len(perm), 64):
                idx = perm[start:start + 64]
                loss = nn.functional.cross_entropy(encoder(train_images[idx]), train_labels[idx])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    encoder.eval().requires_grad_(False)
    return encoder


class Projector(nn.Module):
    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, hidden))

    def forward(self, x):
        return self.net(x)


# ---- prompts ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How an example becomes tokens: ``chat`` uses the tokenizer's template, otherwise ``PLAIN_TEMPLATE``."""
    chat: bool

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "PromptFormat":
        return cls(chat=bool(getattr(tokenizer, "chat_template", None)))

    def prompt_text(self, tokenizer, question: str, image_text: str) -> str:
        if self.chat:
            return tokenizer.apply_chat_template([{"role": "user", "content": f"{image_text}\n{question}"}],
                                                 tokenize=False, add_generation_prompt=True)
        return PLAIN_TEMPLATE.format(image=image_text, question=question)

    def answer_text(self, tokenizer, question: str, image_text: str, answer: str) -> str:
        """What follows the prompt in a finished example, end marker included (it teaches the model to stop)."""
        if self.chat:
            messages = [{"role": "user", "content": f"{image_text}\n{question}"},
                        {"role": "assistant", "content": answer}]
            full = tokenizer.apply_chat_template(messages, tokenize=False)
            prompt = self.prompt_text(tokenizer, question, image_text)
            if not full.startswith(prompt):
                raise ValueError("this chat template does not extend the prompt with the answer; use chat=False")
            return full[len(prompt):]
        return f" {answer}\n"


def _tokens(tokenizer, text: str, first: bool, chat: bool) -> list[int]:
    # The chat template writes its special tokens itself; a plain prompt gets the tokenizer's BOS once, first.
    return tokenizer(text, add_special_tokens=first and not chat)["input_ids"]


def encode_examples(examples: list[Example], tokenizer, fmt: PromptFormat, modality: str, answers: bool = True,
                    padding_side: str = "right") -> dict:
    """A padded batch: input_ids, attention_mask, labels (-100 except answer tokens), image_mask (placeholder
    positions, vision only) and images (every digit of the batch, in order)."""
    if modality not in ("vision", "text"):
        raise ValueError(f"modality must be 'vision' or 'text', got {modality!r}")
    placeholder = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, label_rows, image_rows = [], [], []
    for ex in examples:
        image_text = IMAGE_MARKER if modality == "vision" else ex.text_stand_in
        prompt = fmt.prompt_text(tokenizer, ex.question, image_text)
        before, _, after = prompt.partition(IMAGE_MARKER) if modality == "vision" else (prompt, "", "")
        ids = _tokens(tokenizer, before, True, fmt.chat)
        image = [False] * len(ids)
        if modality == "vision":
            n = PATCHES_PER_DIGIT * len(ex.digits)
            ids += [placeholder] * n
            image += [True] * n
            tail = _tokens(tokenizer, after, False, fmt.chat)
            ids += tail
            image += [False] * len(tail)
        labels = [-100] * len(ids)
        if answers:
            answer = _tokens(tokenizer, fmt.answer_text(tokenizer, ex.question, image_text, ex.answer), False, True)
            ids += answer
            labels += answer
            image += [False] * len(answer)
        rows.append(ids)
        label_rows.append(labels)
        image_rows.append(image)
    width = max(map(len, rows))

    def pad(row, value):
        fill = [value] * (width - len(row))
        return fill + row if padding_side == "left" else row + fill
    batch = {"input_ids": torch.tensor([pad(r, placeholder) for r in rows]),
             "attention_mask": torch.tensor([pad([1] * len(r), 0) for r in rows]),
             "labels": torch.tensor([pad(r, -100) for r in label_rows]),
             "image_mask": torch.tensor([pad(r, False) for r in image_rows])}
    if modality == "vision":
        batch["images"] = torch.cat([ex.images for ex in examples])
    return batch


# ---- the model ------------------------------------------------------------------------------------------------

class DigitVLM(nn.Module):
    """Language model + projector + frozen encoder. ``forward(**batch)`` returns the answer-token loss."""

    def __init__(self, llm: nn.Module, encoder: DigitEncoder, projector: Projector):
        super().__init__()
        self.llm, self.encoder, self.projector = llm, encoder, projector
        self.encoder.requires_grad_(False)

    def embed(self, input_ids, image_mask=None, images=None) -> torch.Tensor:
        embeds = self.llm.get_input_embeddings()(input_ids)
        if images is not None and image_mask is not None and image_mask.any():
            with torch.no_grad():
                patches = self.encoder.patches(images.to(embeds.device, torch.float32))
            tokens = self.projector(patches.flatten(0, 1)).to(embeds.dtype)       # (N * 4, D), reading order
            embeds = embeds.masked_scatter(image_mask[..., None].to(embeds.device), tokens)
        return embeds

    def forward(self, input_ids, attention_mask, labels, image_mask=None, images=None, label_count=None):
        embeds = self.embed(input_ids, image_mask, images)
        return answer_loss(self.llm, embeds, attention_mask, labels, label_count)


def answer_loss(llm, inputs_embeds, attention_mask, labels, label_count=None) -> torch.Tensor:
    """Cross-entropy of the labelled next tokens, the output head applied only where a label is.

    ``label_count``: the number of labelled tokens in the *global* batch (all processes); the loss is then
    sum / label_count * world size, so DDP's gradient average equals the single-process mean."""
    hidden = llm.get_decoder()(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               use_cache=False).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = head_logits(llm, hidden[:, :-1][keep])
    total = nn.functional.cross_entropy(logits, targets[keep], reduction="sum")
    if label_count is None:
        return total / keep.sum().clamp_min(1)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return total * world / label_count


@torch.no_grad()
def generate_answers(vlm: DigitVLM, tokenizer, examples: list[Example], modality: str, fmt: PromptFormat,
                     max_new_tokens: int = 8, batch_size: int = 16) -> list[str]:
    """Greedy answers of the model to the examples' questions (prompt without the answer, left-padded)."""
    out = []
    llm = vlm.llm
    device = next(llm.parameters()).device
    stop = [tokenizer.eos_token_id]
    if not fmt.chat:       # a plain-format answer ends with a line break (PromptFormat.answer_text)
        stop.append(tokenizer("\n", add_special_tokens=False)["input_ids"][-1])
    for start in range(0, len(examples), batch_size):
        batch = encode_examples(examples[start:start + batch_size], tokenizer, fmt, modality, answers=False,
                                padding_side="left")
        embeds = vlm.embed(batch["input_ids"].to(device), batch["image_mask"].to(device),
                           batch.get("images"))
        new = llm.generate(inputs_embeds=embeds, attention_mask=batch["attention_mask"].to(device),
                           max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                           pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        out += [t if fmt.chat else t.split("\n", 1)[0] for t in texts]
    return out


# ---- building, saving, loading ---------------------------------------------------------------------------

def build_vlm(loaded: LoadedModel, encoder: DigitEncoder, seed: int = 0) -> DigitVLM:
    torch.manual_seed(seed)
    hidden = loaded.model.get_input_embeddings().weight.shape[1]
    projector = Projector(encoder.width, hidden).to(next(loaded.model.parameters()).device)
    return DigitVLM(loaded.model, encoder.to(next(loaded.model.parameters()).device), projector)


def save_vlm(vlm: DigitVLM, tokenizer, directory: str | Path, fmt: PromptFormat, record: dict | None = None) -> Path:
    """The language model as a ``save_pretrained`` directory (readable by ``load_model``), plus the vision parts."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vlm.llm.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    from ..interventions.qknorm import qk_norm_state
    torch.save({"encoder": vlm.encoder.state_dict(), "encoder_width": vlm.encoder.width,
                "projector": vlm.projector.state_dict(), "chat": fmt.chat, "qk_norm": qk_norm_state(vlm.llm)},
               directory / VISION_FILE)
    if record is not None:
        (directory / "sinkbook_adaptation.json").write_text(json.dumps(record, indent=1, default=str))
    return directory


def read_vision_file(directory: str | Path) -> dict:
    """The vision parts ``save_vlm`` wrote beside the language model, checked; a missing or damaged file raises
    a one-line error (FileNotFoundError / ValueError), so a caller can check before minutes of other work."""
    path = Path(directory) / VISION_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no {VISION_FILE}: it is not an adapted vision-language model "
                                f"(write one with `sinkbook adapt ... --modality vision --out DIR`)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:          # a truncated zip, a garbled pickle: torch raises several types
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path} is damaged ({reason}); it is written by `sinkbook adapt`: run the adaptation "
                         f"again") from None
    missing = {"encoder", "encoder_width", "projector", "chat"} - set(state if isinstance(state, dict) else ())
    if missing:
        raise ValueError(f"{path} lacks {', '.join(sorted(missing))}; it is not a file `sinkbook adapt` wrote: run the "
                         f"adaptation again")
    return state


def load_vlm(directory: str | Path, device: str = "auto") -> tuple[DigitVLM, LoadedModel, PromptFormat]:
    """(vlm, loaded language model, prompt format) from a directory written by ``save_vlm``."""
    directory = model_directory(directory)          # a run directory stands for its model/
    state = read_vision_file(directory)
    from ..interventions.qknorm import restore_qk_norm
    loaded = load_model(str(directory), device=device)
    restore_qk_norm(loaded.model, state.get("qk_norm"))
    encoder = DigitEncoder(state["encoder_width"])
    encoder.load_state_dict(state["encoder"])
    vlm = build_vlm(loaded, encoder.eval())
    vlm.projector.load_state_dict(state["projector"])
    return vlm.eval(), loaded, PromptFormat(chat=state["chat"])
