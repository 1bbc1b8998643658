"""A Hugging Face `tokenizer.json` rebuilt from a GGUF's own vocabulary, for clients that count
tokens with one (NVIDIA's aiperf: `--tokenizer DIR`) where no model hub is reachable.

    .venv/bin/python benchmarks/gguf_tokenizer.py OUT_DIR [--model PATH]

Byte-level BPE vocabularies only (`tokenizer.ggml.model` "gpt2": SmolLM2, Qwen, Llama 3); the
tokens, merges and special tokens come from the GGUF, so the counts are the server's own. Needs
the `tokenizers` package (`pip install tokenizers`), which the project itself does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gguf import GGUFReader


def _strings(reader: GGUFReader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _scalar(reader: GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.parts[field.data[0]][0])


def build(model: Path, out: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(model)
    kind = bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode()
    if kind != "gpt2":
        raise SystemExit(f"{model}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is rebuilt")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    types = reader.fields["tokenizer.ggml.token_type"]
    control = {i for i, t in enumerate(int(types.parts[j][0]) for j in types.data) if t == 3}
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True) for i in sorted(control)])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    names = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    for name, key in names.items():
        token_id = _scalar(reader, key)
        if token_id is not None:
            config[name] = tokens[token_id]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out / "tokenizer.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory for tokenizer.json and tokenizer_config.json")
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the server's default model)")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from skippy_cache.runtime import default_model_path

        model = default_model_path()
    print(build(model, args.out), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
