"""The checkpoint's own tokenizer (tokenizer.json, read offline) and a streaming detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from qwen3_model.loading import CheckpointError

# Qwen3's end-of-turn and end-of-text tokens; config.json and generation_config.json may add more.
EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")


class Tokenizer:
    """encode/decode plus the ids that end generation (`eos_token_ids`, as mlx-lm names them)."""

    def __init__(self, tokenizer, eos_token_ids=()):
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.eos_token_ids = set(eos_token_ids)
        for token in EOS_TOKENS:
            token_id = tokenizer.token_to_id(token)
            if token_id is not None:
                self.eos_token_ids.add(token_id)

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path).expanduser()
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        try:
            tokenizer = HFTokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise CheckpointError(f"{file}: not a readable tokenizer ({e})") from e
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            try:
                value = json.loads((path / name).read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                continue  # optional here; load() reports a broken config.json
            eos.update(
                v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)
            )
        return cls(tokenizer, eos)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)


class Detokenizer:
    """Text added by each new token. Decodes the whole sequence each time, so a character split
    over several byte-level tokens comes out whole: a trailing partial one is held back."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.tokens, self.emitted = tokenizer, [], ""

    def add_token(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text)

    def finalize(self) -> str:
        return self._emit(self.tokenizer.decode(self.tokens))

    def _emit(self, text: str) -> str:
        segment = text[len(self.emitted) :]
        self.emitted = text
        return segment
