#!/usr/bin/env bash
# Here (with network): what benchmarks/cuda_run.sh needs on the GPU machine, which has none. Writes .whl/ (wheels for
# its Python 3.12 that its image lacks; versions as in .venv) and .gpu/ (the Qwen3.5 tokenizer fixture, the demo's
# config.json and tokenizer). Both are ignored by git (.git/info/exclude) and travel as `carry`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
for d in .whl .gpu; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >>.git/info/exclude; done
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
WHEELS=""
for name in fastapi starlette pydantic pydantic_core annotated-types typing-inspection annotated-doc uvicorn openai \
    jiter gguf sniffio opentelemetry-api httpx2 httpcore2 typing_extensions anyio truststore idna h11 llguidance; do
  WHEELS="$WHEELS $name==$(version "$name")"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
"$PY" -m tests.fixtures.qwen3_5_tokenizer .gpu/qwen3_5_tokenizer
"$PY" - <<'EOF'
import json
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from ascendserve.loader.demo import get_demo_model_path

gguf, out = Path(get_demo_model_path()), Path(".gpu/demo")
out.mkdir(parents=True, exist_ok=True)
config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict()
config = {k: v for k, v in config.items() if k != "quantization_config"} | {"architectures": ["LlamaForCausalLM"]}
(out / "config.json").write_text(json.dumps(config, indent=1))
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
EOF
du -sh .whl .gpu
