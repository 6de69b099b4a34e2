#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-bench, llama-batched-bench, llama-quantize, llama-perplexity) as the anchor `fbs bench` compares
# against, and make its formats of the default model. Opt-in: `make` never runs it (about 10 minutes on 2 cores).
#
# Usage: scripts/build_llama_cpp.sh [PYTHON]    (default: .venv/bin/python; used for pip download and to find
#        the bundled GGUF)
#        FBS_LLAMA_MODELS="smollm2-135m qwen2.5-coder-0.5b" also makes Qwen2.5-Coder-0.5B's formats (its wheels
#        must be installed: `fbs` names them when the model is first used)
# Result: $FBS_CACHE_DIR/llama.cpp/0.3.36/bin/{llama-bench,llama-batched-bench,llama-quantize,llama-perplexity} and
#         $FBS_CACHE_DIR/llama.cpp/0.3.36/models/smollm2-135m.{Q4_1,Q8_0,Q4_0,F16}.gguf
#         (qwen2.5-coder-0.5b.{Q4_K_M,Q8_0,Q4_0}.gguf)
#
# Source: the llama.cpp that the pinned llama-cpp-python sdist vendors (PyPI is the only reachable registry).
# Instruction sets: x86-64 with AVX2/FMA/F16C, plus AVX-512 (F, VNNI, VBMI, BF16) and AVX-VNNI where this CPU has
# them, the same sets fbs's own kernels use, so neither side is handicapped. GGML_NATIVE stays off so the choice is
# explicit and recorded. AMX stays off unless FBS_LLAMA_AMX=1: measured on an Intel Xeon VM of this project whose
# /proc/cpuinfo lists amx_tile / amx_int8 / amx_bf16 (2026-11-27), that build compiles but llama-bench dies at once
# with SIGILL (exit 132), so AMX is not usable by llama.cpp here and the anchor stays the AVX-512 VNNI build.
set -euo pipefail
PY="${1:-.venv/bin/python}"
VERSION=0.3.36
ROOT="${FBS_CACHE_DIR:-$HOME/.cache/fbs}/llama.cpp/$VERSION"
mkdir -p "$ROOT/src" "$ROOT/bin" "$ROOT/models"
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $flags " == *" $1 "* ]]; }
on() { if has "$1"; then echo ON; else echo OFF; fi; }

if [ ! -x "$ROOT/bin/llama-bench" ] || [ ! -x "$ROOT/bin/llama-batched-bench" ]; then
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
  cmake --build "$ROOT/build" -j"$(nproc)" --target llama-bench llama-batched-bench llama-quantize llama-perplexity > "$ROOT/build.log"
  cp "$ROOT"/build/bin/llama-{bench,batched-bench,quantize,perplexity} "$ROOT/bin/"
  grep -E "GGML_(AVX|AMX|NATIVE|FMA|F16C)[A-Z0-9_]*:" "$ROOT/build/CMakeCache.txt" | sort > "$ROOT/bin/flags.txt"
fi

# The formats of each base in FBS_LLAMA_MODELS (default: the default model), from its bundled GGUF (a GGUF shipped in
# parts is assembled once under models/, verified against its pinned sha256); the formats per base are
# fbs.bench.llama_cpp.MODEL_FORMATS, the first being the shipped file's own.
for base in ${FBS_LLAMA_MODELS:-smollm2-135m}; do
  read -r SRCFMT OTHERS < <("$PY" -c "from fbs.bench.llama_cpp import formats_for; print(*formats_for('$base'))")
  GGUF=$("$PY" -c "from fbs.model.bases import bundled_gguf; print(bundled_gguf('$base', '$ROOT/models/assembled'))")
  [ -f "$ROOT/models/$base.$SRCFMT.gguf" ] || ln -f "$GGUF" "$ROOT/models/$base.$SRCFMT.gguf" 2>/dev/null \
    || cp "$GGUF" "$ROOT/models/$base.$SRCFMT.gguf"
  for fmt in $OTHERS; do
    out="$ROOT/models/$base.$fmt.gguf"
    [ -f "$out" ] || "$ROOT/bin/llama-quantize" --allow-requantize "$ROOT/models/$base.$SRCFMT.gguf" "$out" "$fmt" \
      > "$ROOT/models/quantize-$base-$fmt.log" 2>&1
  done
done
echo "llama.cpp $VERSION ready in $ROOT (flags: $ROOT/bin/flags.txt)"
