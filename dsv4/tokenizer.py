"""Byte-level BPE tokenizer: train one with `tokenizers`, or load a checkpoint's `tokenizer.json`.

Special tokens follow V4's names: id 0 is BOS `<｜begin▁of▁sentence｜>`, id 1 is EOS
`<｜end▁of▁sentence｜>` when we train the tokenizer (they are the first special tokens added).
Loading an existing `tokenizer.json` reads the ids of those names (or of `tokenizer_config.json`'s
`bos_token` / `eos_token`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import UserError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with BOS/EOS ids and batch encoding."""

    def __init__(self, tok, bos_token: str = BOS, eos_token: str = EOS):
        self.tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id = tok.token_to_id(bos_token)
        self.eos_id = tok.token_to_id(eos_token)
        if self.bos_id is None or self.eos_id is None:
            raise UserError(f"tokenizer has no id for BOS '{bos_token}' or EOS '{eos_token}'")

    # ------------------------------------------------------------------ construction
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> Tokenizer:
        """Train a byte-level BPE on an iterator of documents (deterministic for a fixed input order)."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < 258 + 2:
            raise UserError(f"vocab_size must be at least 260 for a byte-level BPE, got {vocab_size}")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[BOS, EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (path to the file or to a directory holding it)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise UserError(
                f"{file}: no tokenizer.json here; train one with `dsv4 train` or point to a "
                "checkpoint directory that has one"
            )
        from .safe_paths import contained, read_text

        if path.is_dir():
            contained(path, "tokenizer.json", str(path))  # a checkpoint's files stay inside it
        try:
            tok = HFTokenizer.from_str(read_text(file))  # a regular file of bounded size: never blocks
        except UserError:
            raise
        except Exception as e:  # the library raises a bare Exception for malformed files
            raise UserError(f"{file}: not a valid tokenizer.json ({str(e)[:200]})") from None
        bos, eos = BOS, EOS
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.exists():
            try:
                cfg = json.loads(read_text(cfg_file))
                bos, eos = _token_str(cfg.get("bos_token"), bos), _token_str(cfg.get("eos_token"), eos)
            except (ValueError, AttributeError, TypeError, RecursionError) as e:
                raise UserError(f"{cfg_file}: not a valid tokenizer_config.json ({str(e)[:200]})") from None
        return cls(tok, bos, eos)

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json and tokenizer_config.json into directory."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "bos_token": self.bos_token,
                    "eos_token": self.eos_token,
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "add_bos_token": True,
                    "add_eos_token": False,
                },
                indent=2,
                ensure_ascii=False,
            )
            + "\n"
        )
        return d / "tokenizer.json"

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_releasing_gil(self, text: str, bos: bool = False) -> list[int]:
        """`encode`, with the interpreter lock released while the Rust tokenizer runs (its batch entry point
        does that; the single-text one does not), so that a server's event loop goes on meanwhile."""
        ids = self.tok.encode_batch([text], add_special_tokens=False)[0].ids
        return ([self.bos_id] if bos else []) + ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, the texts in parallel; without the character offsets where the tokenizers
        library can skip them (`encode_batch_fast`, tokenizers >= 0.21: the same ids, a quarter less time)."""
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (b"" for special tokens), for token healing (`dsv4.engine.healing`): a byte-level
        tokenizer's tokens mapped back through its byte alphabet, any other's decoded one by one."""
        n = self.vocab_size
        special = set(self.tok.get_added_tokens_decoder())
        if type(self.tok.decoder).__name__ == "ByteLevel":
            to_byte = {c: b for b, c in _byte_alphabet().items()}
            out = []
            for i in range(n):
                piece = self.tok.id_to_token(i)
                ok = i not in special and piece is not None and all(c in to_byte for c in piece)
                out.append(bytes(to_byte[c] for c in piece) if ok else b"")
            return out
        texts = [self.decode([i]) if i not in special else "" for i in range(n)]
        return [b"" if "\ufffd" in t else t.encode("utf-8") for t in texts]

    def decode_stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield text pieces as ids arrive (each piece is the newly completed text; handles UTF-8 that
        spans several byte tokens)."""
        seen: list[int] = []
        printed = ""
        for i in ids:
            seen.append(int(i))
            text = self.decode(seen)
            if text.endswith("\ufffd"):
                continue
            yield text[len(printed) :]
            printed = text


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in of each byte: printable Latin-1 bytes stand for themselves, the
    others (controls, space, soft hyphen, ...) are the characters from U+0100 on, in byte order."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _token_str(v, default: str) -> str:
    if isinstance(v, dict):
        return v.get("content", default)
    return v if isinstance(v, str) else default


class ByteTokenizer:
    """UTF-8 bytes as token ids, for models without a tokenizer (a preset with random weights).

    Ids 0..255 are bytes; `bos_id` / `eos_id` (the config's) are special: skipped when decoding with
    skip_special_tokens. Ids of 256 and above have no text.
    """

    def __init__(self, bos_id: int = 0, eos_id: int = 1):
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_releasing_gil(self, text: str, bos: bool = False) -> list[int]:
        return self.encode(text, bos=bos)

    def token_bytes(self) -> list[bytes]:
        """Ids 0..255 are one byte each (BOS and EOS: b""): no token extends another, so token healing
        never removes one."""
        return [b"" if i in (self.bos_id, self.eos_id) else bytes([i]) for i in range(256)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        special = {self.bos_id, self.eos_id} if skip_special_tokens else set()
        return bytes(i for i in ids if i < 256 and i not in special).decode("utf-8", errors="replace")
