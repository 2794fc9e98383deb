#!/usr/bin/env bash
# Builds native llama.cpp, the CPU peer of benchmarks/e2e_cpu_peers.py (--llama-cpp-bin), from the sources that
# ship inside the llama-cpp-python sdist on PyPI (no other download): llama-completion (vanilla), llama-bench and
# llama-speculative-simple (its EAGLE-3 drafting), for this machine's CPU (GGML_NATIVE). ~8 minutes on 2 cores.
#
#   bash benchmarks/build_llama_cpp.sh [DIR]      # default DIR: benchmarks/.llama.cpp (git-ignored)
#
# Then converts the shipped EAGLE-3 head for llama.cpp's EAGLE-3 drafting (DIR/bin/eagle3-head.gguf, with
# llama.cpp's convert_hf_to_gguf.py --target-model-dir: the target's config and tokenizer are written from its
# GGUF; the converter's one extra package, sentencepiece, goes to DIR/pylib).
# Prints the directory of the binaries (DIR/bin). LLAMA_CPP_PYTHON_VERSION pins the sdist (default: the newest).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$(mkdir -p "${1:-$root/benchmarks/.llama.cpp}" && cd "${1:-$root/benchmarks/.llama.cpp}" && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python=python3
for tool in cmake c++ tar; do
  command -v "$tool" > /dev/null || { echo "build_llama_cpp.sh: $tool is not installed" >&2; exit 1; }
done

spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
if ! ls "$dir"/llama_cpp_python-*.tar.gz > /dev/null 2>&1; then
  echo "downloading the $spec sdist" >&2
  "$python" -m pip download --quiet --no-deps --no-binary :all: "$spec" -d "$dir" >&2
fi
sdist="$(ls "$dir"/llama_cpp_python-*.tar.gz | sort -V | tail -1)"
src="$dir/$(basename "$sdist" .tar.gz)"
[ -d "$src" ] || tar -xzf "$sdist" -C "$dir"
cmake -S "$src/vendor/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF > "$dir/cmake.log" 2>&1 || { tail -20 "$dir/cmake.log" >&2; exit 1; }
cmake --build "$dir/build" -j "$(nproc)" --target llama-completion llama-bench llama-speculative-simple \
  > "$dir/build.log" 2>&1 || { tail -20 "$dir/build.log" >&2; exit 1; }
mkdir -p "$dir/bin"
for exe in llama-completion llama-bench llama-speculative-simple; do
  ln -sf "$dir/build/bin/$exe" "$dir/bin/$exe"
done

head="$root/engine/heads/smollm2-135m-eagle3"
# converted again whenever the shipped head is newer than its conversion (a retrained head ships)
if [ ! -f "$dir/bin/eagle3-head.gguf" ] || [ "$head/model.safetensors" -nt "$dir/bin/eagle3-head.gguf" ]; then
  "$python" -m pip install --quiet --target "$dir/pylib" sentencepiece >&2
  (cd "$root" && "$python" - "$dir/target-hf" <<'EOF'
import sys
from transformers import AutoConfig
from engine.loader import load_tokenizer, resolve_model
src = resolve_model("smollm2-135m")
AutoConfig.from_pretrained(str(src.path.parent), gguf_file=src.path.name).save_pretrained(sys.argv[1])
load_tokenizer(src).save_pretrained(sys.argv[1])
EOF
  )
  PYTHONPATH="$dir/pylib" "$python" "$src/vendor/llama.cpp/convert_hf_to_gguf.py" "$head" \
    --target-model-dir "$dir/target-hf" --outfile "$dir/bin/eagle3-head.gguf" --outtype bf16 > "$dir/convert.log" 2>&1 \
    || { tail -20 "$dir/convert.log" >&2; exit 1; }
fi
echo "$dir/bin"
