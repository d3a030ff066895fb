"""The tiny model and LoRA adapter the real-vLLM tier serves (``test_vllm_cpu.py``), written by the
test: a 2-layer Llama config with the bundled SmolLM2 tokenizer (vLLM loads it with ``--load-format
dummy``), and a rank-8 adapter of zero weights; and the chat token count the engine must agree with."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jinja2
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL_SRC = ROOT / "libs" / "infera_common" / "models" / "SmolLM2-135M-Instruct"

#: The tiny model: the bundled SmolLM2 config shrunk to 2 layers, hidden 128, 2 heads of 64.
TINY_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def write_tiny_model(dest: Path) -> Path:
    """A model directory vLLM loads with --load-format dummy: config + the bundled tokenizer."""
    dest.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(MODEL_SRC / name, dest / name)
    config = json.loads((MODEL_SRC / "config.json").read_text())
    config.pop("transformers.js_config", None)
    vocab = json.loads((MODEL_SRC / "tokenizer_config.json").read_text()).get("vocab_size", config["vocab_size"])
    config.update(TINY_CONFIG, vocab_size=vocab)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


#: A LoRA adapter of the tiny model (rank 8 on q_proj and v_proj, zero weights: vLLM loads and runs
#: it as any adapter), written with the vLLM interpreter's torch and safetensors.
WRITE_ADAPTER = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
dest, hidden, layers = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dest.mkdir(parents=True)
(dest / "adapter_config.json").write_text(json.dumps({
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
    "bias": "none", "target_modules": ["q_proj", "v_proj"]}))
weights = {}
for i in range(layers):
    for proj in ("q_proj", "v_proj"):
        prefix = f"base_model.model.model.layers.{i}.self_attn.{proj}"
        weights[prefix + ".lora_A.weight"] = torch.zeros(8, hidden)
        weights[prefix + ".lora_B.weight"] = torch.zeros(hidden, 8)
save_file(weights, str(dest / "adapter_model.safetensors"))
"""
ADAPTER = "sql-lora"


def write_adapter(python: str, dest: Path) -> Path:
    subprocess.run([python, "-c", WRITE_ADAPTER, str(dest), str(TINY_CONFIG["hidden_size"]),
                    str(TINY_CONFIG["num_hidden_layers"])], check=True, timeout=120)
    return dest


def chat_token_count(model: Path, content: str) -> int:
    """The prompt's token count as the model's own chat template and tokenizer give it (no BOS added)."""
    config = json.loads((model / "tokenizer_config.json").read_text())
    text = jinja2.Environment().from_string(config["chat_template"]).render(
        messages=[{"role": "user", "content": content}], add_generation_prompt=True)
    return len(Tokenizer.from_file(str(model / "tokenizer.json")).encode(text, add_special_tokens=False).ids)
