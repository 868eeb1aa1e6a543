"""Training data: documents -> tokens -> packed fixed-length windows, deterministic order, resumable.

Corpus: text files (`--data` paths: files or directories, `*.py`/`*.txt`/`*.md` ... by suffix, or a corpus
manifest written by `python3 -m dsv4.train.corpus`: the standard library and installed packages, hashed),
by default the Python standard library's own `.py` sources, present wherever Python is.

Documents and held-out split: each file is one document; a document goes to the held-out set when a
stable hash of its path relative to its root falls in the first `held_out_pct` percent, so the split does
not depend on file order or machine.

Packing (the document-boundary choice): every document is wrapped as `BOS tokens EOS` and the
documents are concatenated into one stream, cut into windows of `seq_len` tokens. A window can hold
the end of one document and the start of the next; attention is *not* masked at the boundary (the
model's window and compressed branches run over positions 0..s-1 of the window), but every document
starts with BOS, so the model learns that BOS resets the context. This keeps every token used and
every window full, which makes per-token losses equal-weighted across data-parallel ranks.

Order: windows are visited in a per-epoch permutation from `torch.Generator(seed + epoch)`. The
position (epoch, index into the permutation) is the loader's whole state: saving and restoring it
resumes the exact sequence of batches. A global batch is split across ranks by rows, so a run on W
processes sees the same global batches as a run on one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from ..tokenizer import Tokenizer

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".toml", ".c", ".h", ".cpp", ".js", ".html")


# ------------------------------------------------------------------------------------------ corpus
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def find_documents(paths: list[str | Path] | None = None) -> list[tuple[str, Path]]:
    """(relative name, path) of every text document, sorted by name. None = the Python stdlib's .py."""
    roots: list[tuple[Path, tuple[str, ...]]]
    if not paths:
        roots = [(stdlib_root(), (".py",))]
    else:
        roots = [(Path(p), TEXT_SUFFIXES) for p in paths]
    from .corpus import is_manifest, read_manifest  # here: `python3 -m dsv4.train.corpus` runs it as __main__

    docs: list[tuple[str, Path]] = []
    for root, suffixes in roots:
        if not root.exists():
            raise UserError(f"--data {root}: no such file or directory")
        if is_manifest(root):  # a corpus manifest (dsv4.train.corpus): its files, hashes checked
            docs.extend(read_manifest(root))
            continue
        if root.is_file():
            docs.append((root.name, root))
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in ("site-packages", "dist-packages", "__pycache__") and not d.startswith(".")
            )
            for f in sorted(filenames):
                if f.endswith(suffixes):
                    p = Path(dirpath) / f
                    docs.append((str(p.relative_to(root)), p))
    if not docs:
        raise UserError(f"no text documents found under {[str(r) for r, _ in roots]}")
    return sorted(docs)


def spread(docs: list[tuple[str, Path]], n: int) -> list[tuple[str, Path]]:
    """At most n documents taken evenly across the sorted list (deterministic); n <= 0 keeps all."""
    if n <= 0 or len(docs) <= n:
        return docs
    return [docs[i * len(docs) // n] for i in range(n)]


MAX_DOCUMENT_BYTES = 64 << 20  # one training / evaluation document


def read_text(path: Path) -> str:
    """A document's text (undecodable bytes replaced): a regular file of at most MAX_DOCUMENT_BYTES,
    opened without blocking (a FIFO or device among the documents is refused by name, not read)."""
    from ..safe_paths import read_bytes

    return read_bytes(path, MAX_DOCUMENT_BYTES, f"document {path}").decode("utf-8", errors="replace")


def is_held_out(name: str, pct: float) -> bool:
    h = int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "little")
    return (h % 10000) < pct * 100


# ------------------------------------------------------------------------------------------ tokens
def tokenize_corpus(
    tok: Tokenizer, docs: list[tuple[str, Path]], held_out_pct: float, cache_dir: str | Path | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """-> (train stream, held-out stream) of token ids, each document as BOS ... EOS.

    With cache_dir, the streams are stored as .npy files keyed by the tokenizer and the file list.
    """
    key = hashlib.sha256()
    key.update(tok.tok.to_str().encode())
    for name, p in docs:
        key.update(f"{name}:{p.stat().st_size}\n".encode())
    key.update(f"{held_out_pct}".encode())
    digest = key.hexdigest()[:16]
    if cache_dir is not None:
        cache = Path(cache_dir)
        files = cache / f"tokens-{digest}-train.npy", cache / f"tokens-{digest}-heldout.npy"
        if all(f.exists() for f in files):
            return np.load(files[0]), np.load(files[1])
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32
    parts: dict[bool, list[np.ndarray]] = {True: [], False: []}
    batch = 512  # documents per call: the tokenizer runs a call's documents in parallel
    for i in range(0, len(docs), batch):
        chunk = docs[i : i + batch]
        ids = tok.encode_batch([read_text(p) for _, p in chunk])
        for (name, _), seq in zip(chunk, ids):
            arr = np.empty(len(seq) + 2, dtype=dtype)
            arr[0], arr[-1] = tok.bos_id, tok.eos_id
            arr[1:-1] = seq
            parts[is_held_out(name, held_out_pct)].append(arr)
    train = np.concatenate(parts[False]) if parts[False] else np.zeros(0, dtype)
    held = np.concatenate(parts[True]) if parts[True] else np.zeros(0, dtype)
    if cache_dir is not None:
        cache.mkdir(parents=True, exist_ok=True)
        for arr, f in zip((train, held), files):
            tmp = f.with_suffix(".tmp.npy")
            np.save(tmp, arr)
            os.replace(tmp, f)
    return train, held


# ------------------------------------------------------------------------------------------ loader
@dataclass
class LoaderState:
    epoch: int = 0
    index: int = 0  # windows of the current epoch's permutation already consumed

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}


class PackedLoader:
    """Global batches [batch_size, seq_len] of packed windows; this rank's rows of each."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
    ):
        if batch_size % world:
            raise UserError(f"--batch-size {batch_size} must be divisible by the {world} processes")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.rank, self.world, self.shuffle = rank, world, shuffle
        self.n_windows = len(tokens) // seq_len
        if self.n_windows < batch_size:
            raise UserError(
                f"the data holds {self.n_windows} windows of {seq_len} tokens, fewer than one "
                f"batch of {batch_size}; use more data or a smaller --seq-len / --batch-size"
            )
        self.state = LoaderState()
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n_windows, generator=g)
            else:
                self._perm = torch.arange(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> torch.Tensor:
        """-> this rank's rows [batch_size / world, seq_len] int64 of the next global batch."""
        st = self.state
        if st.index + self.batch_size > self.n_windows:  # drop the incomplete tail of an epoch
            st.epoch, st.index = st.epoch + 1, 0
        ids = self._permutation(st.epoch)[st.index : st.index + self.batch_size]
        st.index += self.batch_size
        per = self.batch_size // self.world
        ids = ids[self.rank * per : (self.rank + 1) * per]
        starts = ids * self.seq_len
        return self.tokens[starts.unsqueeze(1) + torch.arange(self.seq_len)]

    def state_dict(self) -> dict:
        return self.state.to_dict() | {
            "seed": self.seed,
            "n_windows": self.n_windows,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, d: dict) -> None:
        for k in ("n_windows", "seq_len", "batch_size"):
            if d.get(k) != getattr(self, k):
                raise UserError(
                    f"checkpoint data-loader state has {k}={d.get(k)}, this run has "
                    f"{getattr(self, k)}: resume with the same data, --seq-len and --batch-size"
                )
        self.state = LoaderState(int(d["epoch"]), int(d["index"]))


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """The first max_windows consecutive windows of a stream (fixed held-out set) [n, seq_len]."""
    n = min(len(tokens) // seq_len, max_windows)
    if n == 0:
        raise UserError(f"the held-out split holds fewer than {seq_len} tokens; raise --held-out-pct")
    return torch.from_numpy(tokens[: n * seq_len].astype(np.int64)).view(n, seq_len)


def corpus_summary(docs: list[tuple[str, Path]], train: np.ndarray, held: np.ndarray) -> str:
    return json.dumps({"documents": len(docs), "train_tokens": int(len(train)), "held_out_tokens": int(len(held))})
