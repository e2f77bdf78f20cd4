import functools
import os

import pytest
import torch

from sinkbook.core.models import TINY_FAMILIES, load_model

REAL_MODELS = ("smollm2-135m-instruct", "gemma3-270m")


@functools.lru_cache(maxsize=None)
def _cached(spec):
    return load_model(spec, device="cpu")


@pytest.fixture(params=TINY_FAMILIES)
def tiny(request):
    return _cached(f"tiny-{request.param}")


@pytest.fixture(params=REAL_MODELS)
def real(request):
    return _cached(request.param)


@pytest.fixture
def loaded_model():
    """Any spec, cached across tests: loaded_model('tiny-llama')."""
    return _cached


@pytest.fixture
def ids():
    torch.manual_seed(1)
    return torch.randint(0, 256, (2, 20))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Adaptation runs of a test go to a fresh cache (shared by the chapter tests that train); corpora and the encoder are linked from the real one."""
    from sinkbook.core.paths import cache_root
    real = cache_root()
    monkeypatch.setenv("SINKBOOK_CACHE", str(tmp_path))
    for name in ("shakespeare", "vision"):
        if (real / name).exists():
            os.symlink(real / name, tmp_path / name)
    return tmp_path
