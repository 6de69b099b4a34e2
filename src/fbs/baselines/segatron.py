"""A Segatron-style baseline (Bai et al., "Segatron: Segment-Aware Transformer for Language Modeling and
Understanding", AAAI 2021) on a pretrained decoder: Group D of the paper, placed next to CH (appendix D).

Segatron replaces a token's single position by three: the index of its paragraph, of its sentence within the
paragraph, and of the token within the sentence. Here the three get learned embedding tables whose sum is added to
the token embedding at the input of the pretrained decoder, which keeps its own rotary positions::

    x_t = E_tok[id_t] + E_par[min(p_t, P-1)] + E_sen[min(s_t, S-1)] + E_pos[min(k_t, K-1)]

The tables start at zero, so a fresh model is the base model exactly (its logits are the base's, bit for bit).
Fine-tuning trains the tables and, by default, LoRA adapters of the same rank and targets as the Stage-1 recipe
that trained CH (``fbs train segatron``), so the two compare at an equal budget.

**Segments from the token stream, causally.** A token's indices depend on it and the tokens before it only, so the
model stays a causal LM (``tests/test_segatron.py`` checks that the output at t ignores tokens after t). The text
is seen as the bytes of the tokens (:func:`token_bytes_table`; special tokens count as a newline, a document
break). Boundaries sit between two bytes, at byte offset q:

* **paragraph** at q when byte q-1 is a newline and byte q is not (a run of newlines is one break);
* **sentence** at q when the bytes before q end with a Chinese terminator (。！？), or byte q-1 is an ASCII
  terminator (``.!?``) and byte q is whitespace (so ``3.14`` and ``os.path`` do not end a sentence).

A boundary at q applies from the token whose bytes start at or after q: the token that begins at q starts the new
segment, and a boundary inside a token (``".\\n"`` as one token) applies from the next token. Deciding a boundary
at q reads bytes up to q, which belong to the token that starts at or contains q, so token t's indices read tokens
0..t only. A paragraph boundary resets the sentence index, each boundary resets the token index. Indices count
from the start of the sequence (a training block may start mid-paragraph: its first tokens are paragraph 0), and
are clipped to the last row of their table.

Checkpoints (:meth:`Segatron.save_pretrained`): ``segatron.safetensors`` (tables and LoRA factors),
``segatron_config.json`` (the config with the base model's name and weight fingerprint) and
``segatron_manifest.json`` (size and sha256 of the weights file), written atomically; loading verifies the record
and refuses a checkpoint made for other base weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..model.errors import CheckpointError, read_tensors
from ..model.lora import DEFAULT_TARGETS, add_adapters

CONFIG_NAME = "segatron_config.json"
WEIGHTS_NAME = "segatron.safetensors"
MANIFEST_NAME = "segatron_manifest.json"

NEWLINE = 0x0A
WHITESPACE = frozenset(b" \t\r\n\x0b\x0c")
ASCII_TERMINATORS = frozenset(b".!?")
CJK_TERMINATORS = tuple(c.encode() for c in "。！？")


class SegatronError(ValueError):
    """A Segatron config or checkpoint is invalid, or made for another base model."""


@dataclasses.dataclass
class SegatronConfig:
    """Table sizes and the LoRA of the fine-tune; every default is defined here only."""

    max_paragraphs: int = 64
    """Rows of the paragraph table P; later paragraphs share the last row."""
    max_sentences: int = 128
    """Rows of the sentence-in-paragraph table S."""
    max_tokens: int = 512
    """Rows of the token-in-sentence table K."""
    lora_rank: int = 8
    """LoRA rank on the decoder layers (0 = no LoRA, the tables alone train); Stage-1's rank by default."""
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    base_model: str | None = None
    """Name or path of the base model (filled in by Segatron.from_base)."""
    base_fingerprint: str | None = None
    """Content hash of the base weights (before LoRA); a checkpoint refuses to load onto other weights."""

    def __post_init__(self) -> None:
        self.lora_targets = tuple(self.lora_targets)
        for name in ("max_paragraphs", "max_sentences", "max_tokens"):
            if int(getattr(self, name)) < 1:
                raise SegatronError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lora_rank < 0:
            raise SegatronError(f"lora_rank must be >= 0 (0 = no LoRA), got {self.lora_rank}")


# --------------------------------------------------------------------------- segments from the token stream


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE vocabularies (GPT-2, SmolLM2, Qwen)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = dict(zip(keep, keep)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


def token_bytes_table(tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """The bytes each token id stands for: byte-level BPE symbols decoded to their bytes, SentencePiece ``▁`` as a
    space and ``<0xNN>`` as byte NN, anything else as its UTF-8. Special and added tokens, and ids the tokenizer
    does not know (an embedding matrix padded past the vocabulary), count as a newline (a document break)."""
    n = vocab_size if vocab_size is not None else len(tokenizer)
    decoder = {c: b for b, c in _bytes_to_unicode().items()}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    known = min(n, len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(known)))
    out: list[bytes] = []
    for i in range(n):
        piece = pieces[i] if i < known else None
        if i in special or piece is None:
            out.append(b"\n")
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        elif piece and all(c in decoder for c in piece):
            out.append(bytes(decoder[c] for c in piece))
        else:
            out.append(piece.replace("▁", " ").encode("utf-8"))
    return out


def segment_indices(ids: Sequence[int], table: Sequence[bytes]) -> tuple[list[int], list[int], list[int]]:
    """(paragraph, sentence in paragraph, token in sentence) index of each token of one sequence, unclipped.

    ``table[id]``: the bytes of token ``id`` (:func:`token_bytes_table`). The rules are the module's; the loop
    reads each byte once and keeps only the last three bytes before it, so it is causal by construction."""
    par, sen, tok = [], [], []
    p = s = 0
    start = 0            # index of the first token of the current sentence
    tail = b""           # the last (up to) three bytes of the stream before the byte being read
    pending: list[str] = []  # boundaries found inside the previous token, applying from this one
    for t, token in enumerate(ids):
        data = table[int(token)]
        for kind in pending:
            p, s = (p + 1, 0) if kind == "P" else (p, s + 1)
            start = t
        pending = []
        for j, byte in enumerate(data):
            kind = None
            if tail:
                if tail[-1] == NEWLINE and byte != NEWLINE:
                    kind = "P"
                elif tail.endswith(CJK_TERMINATORS) or (tail[-1] in ASCII_TERMINATORS and byte in WHITESPACE):
                    kind = "S"
            if kind is not None:
                if j == 0:  # the boundary is at this token's first byte: it starts the new segment
                    p, s = (p + 1, 0) if kind == "P" else (p, s + 1)
                    start = t
                else:
                    pending.append(kind)
            tail = (tail + bytes([byte]))[-3:]
        par.append(p), sen.append(s), tok.append(t - start)
    return par, sen, tok


# --------------------------------------------------------------------------- the model


class Segatron(nn.Module):
    """Segment embeddings (and LoRA adapters) over a pretrained HF causal LM; ``forward`` returns HF's output."""

    def __init__(self, hf: nn.Module, tokenizer=None, config: SegatronConfig | None = None,
                 token_bytes: Sequence[bytes] | None = None):
        super().__init__()
        self.config = config or SegatronConfig()
        self.hf = hf
        self.tokenizer = tokenizer
        emb = hf.get_input_embeddings()
        vocab, d = emb.weight.shape
        if token_bytes is None:
            if tokenizer is None:
                raise SegatronError("Segatron needs a tokenizer or a token_bytes table to find sentence and paragraph "
                                    "ends in the token stream")
            token_bytes = token_bytes_table(tokenizer, vocab)
        if len(token_bytes) < vocab:
            raise SegatronError(f"token_bytes covers {len(token_bytes)} ids, the embedding has {vocab}")
        self.token_bytes = list(token_bytes)
        cfg, dtype = self.config, emb.weight.dtype
        self.paragraph = nn.Embedding(cfg.max_paragraphs, d, dtype=dtype)
        self.sentence = nn.Embedding(cfg.max_sentences, d, dtype=dtype)
        self.position = nn.Embedding(cfg.max_tokens, d, dtype=dtype)
        for table in self.segment_tables():
            nn.init.zeros_(table.weight)
        self.lora_names: list[str] = []
        if cfg.lora_rank:
            self.lora_names = add_adapters(hf.model.layers, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)

    @classmethod
    def from_base(cls, base, config: SegatronConfig | None = None, tokenizer=None,
                  token_bytes: Sequence[bytes] | None = None) -> "Segatron":
        """``base``: an HF causal LM instance or a bundled name / HF directory; fresh (zero) tables and LoRA.
        ``token_bytes``: the bytes of each token id (default: :func:`token_bytes_table` of the tokenizer)."""
        from ..model.bases import base_fingerprint, load_base

        name = None
        if not isinstance(base, nn.Module):
            name = str(base)
            base, tok = load_base(base)
            tokenizer = tokenizer or tok
        cfg = dataclasses.replace(config or SegatronConfig(), base_fingerprint=base_fingerprint(base),
                                  base_model=name or (config.base_model if config else None)
                                  or getattr(base.config, "name_or_path", None))
        return cls(base, tokenizer, cfg, token_bytes)

    # ---- what trains -------------------------------------------------------------------------------
    def segment_tables(self) -> tuple[nn.Embedding, nn.Embedding, nn.Embedding]:
        return self.paragraph, self.sentence, self.position

    def segment_parameters(self):
        for table in self.segment_tables():
            yield table.weight

    def lora_parameters(self):
        yield from (p for n, p in self.hf.named_parameters() if "lora_" in n)

    def trainable_counts(self) -> dict[str, int]:
        seg = sum(p.numel() for p in self.segment_parameters())
        lora = sum(p.numel() for p in self.lora_parameters())
        return {"segment_tables": seg, "lora": lora, "total": seg + lora}

    # ---- forward -----------------------------------------------------------------------------------
    def indices(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, 3) long: clipped (paragraph, sentence, token) indices of each row (:func:`segment_indices`)."""
        cfg = self.config
        limits = torch.tensor([cfg.max_paragraphs - 1, cfg.max_sentences - 1, cfg.max_tokens - 1])
        rows = [torch.tensor(segment_indices(row, self.token_bytes)).T for row in input_ids.tolist()]  # (T, 3) each
        out = torch.stack(rows) if rows else torch.zeros(0, input_ids.shape[1], 3, dtype=torch.long)
        return torch.minimum(out, limits).to(input_ids.device)

    def segment_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T, d): the sum of the three tables' rows at each token's indices."""
        idx = self.indices(input_ids)
        return self.paragraph(idx[..., 0]) + self.sentence(idx[..., 1]) + self.position(idx[..., 2])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                logits_to_keep: int = 0, output_hidden_states: bool = False, **kwargs):
        """HF's causal-LM output for ``inputs_embeds`` = token embedding + segment embedding."""
        x = self.hf.get_input_embeddings()(input_ids) + self.segment_embedding(input_ids)
        return self.hf(inputs_embeds=x, attention_mask=attention_mask, logits_to_keep=logits_to_keep,
                       output_hidden_states=output_hidden_states, **kwargs)

    # ---- checkpoints -------------------------------------------------------------------------------
    def segatron_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"{name}.weight": t.weight for name, t in zip(("paragraph", "sentence", "position"),
                                                            self.segment_tables())}
        sd.update({f"hf.{n}": p for n, p in self.hf.named_parameters() if "lora_" in n})
        return {k: v.detach().contiguous().cpu() for k, v in sd.items()}

    def save_pretrained(self, path: str | os.PathLike, meta: dict | None = None) -> Path:
        """Tables and LoRA factors (safetensors), config (JSON, with ``meta`` under ``extra``) and the integrity
        record, written into a temporary directory and renamed into ``path`` file by file (the record last)."""
        from safetensors.torch import save_file

        from ..model.bases import sha256_record

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-") as tmp:
            save_file(self.segatron_state_dict(), os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
            cfg = {**dataclasses.asdict(self.config), "extra": meta or {}}
            Path(tmp, CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True))
            record = {"format": "fbs-manifest/1", "files": sha256_record(tmp)}
            Path(tmp, MANIFEST_NAME).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            for name in (WEIGHTS_NAME, CONFIG_NAME, MANIFEST_NAME):
                os.replace(os.path.join(tmp, name), path / name)
        return path

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, base=None, tokenizer=None, *,
                        check_base: bool = True) -> "Segatron":
        """Load a checkpoint onto ``base`` (default: the base model recorded in it). Refuses, with
        :class:`SegatronError`, weights the integrity record does not vouch for, other base weights, and a
        checkpoint that records no base fingerprint unless ``check_base=False``."""
        from ..model.bases import base_fingerprint, sha256_file

        path = Path(path)
        cfg_file, w_file, rec_file = path / CONFIG_NAME, path / WEIGHTS_NAME, path / MANIFEST_NAME
        if not cfg_file.is_file() or not w_file.is_file():
            raise SegatronError(f"{path} is not a Segatron checkpoint: expected {CONFIG_NAME} and {WEIGHTS_NAME}; "
                                "pass the `final` directory `fbs train segatron` wrote")
        try:
            raw = json.loads(cfg_file.read_text())
            raw.pop("extra", None)
            cfg = SegatronConfig(**raw)
            record = json.loads(rec_file.read_text())["files"][WEIGHTS_NAME]
        except FileNotFoundError:
            raise SegatronError(f"{path} has no integrity record ({MANIFEST_NAME}): its weights cannot be verified; "
                                "copy the whole checkpoint directory again") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SegatronError(f"{cfg_file} or {rec_file} is malformed ({e!r}); restore the files `fbs train "
                                "segatron` wrote") from e
        if w_file.stat().st_size != record["bytes"] or sha256_file(w_file) != record["sha256"]:
            raise SegatronError(f"{w_file} does not match its integrity record ({MANIFEST_NAME}): it is truncated or "
                                "was modified after it was saved; copy the checkpoint again")
        if check_base and cfg.base_fingerprint is None:
            raise SegatronError(f"{path} records no base_fingerprint in {CONFIG_NAME}, so nothing shows it belongs to "
                                "the given base model; load with check_base=False only if you know the base is right")
        if base is None:
            if cfg.base_model is None:
                raise SegatronError(f"{path} records no base model; pass base=")
            base = cfg.base_model
        if not isinstance(base, nn.Module):
            from ..model.bases import load_base

            base, tok = load_base(base)
            tokenizer = tokenizer or tok
        if check_base and base_fingerprint(base) != cfg.base_fingerprint:
            raise SegatronError(f"{path} was trained on other base weights (fingerprint {cfg.base_fingerprint}, "
                                f"the given base has {base_fingerprint(base)}); load it with the base it was made for")
        model = cls(base, tokenizer, cfg)
        try:
            sd = read_tensors(w_file, "copy the checkpoint again or retrain it (fbs train segatron)")
        except CheckpointError as e:
            raise SegatronError(str(e)) from e
        own = {k: v for k, v in model.state_dict().items()
               if k.startswith(("paragraph.", "sentence.", "position.")) or "lora_" in k}
        shapes = [k for k in sd if k in own and tuple(sd[k].shape) != tuple(own[k].shape)]
        if set(sd) != set(own) or shapes:
            raise SegatronError(f"{w_file} does not fit {CONFIG_NAME} and this base: missing "
                                f"{sorted(set(own) - set(sd))[:3]}, unexpected {sorted(set(sd) - set(own))[:3]}, "
                                f"shape mismatches {shapes[:3]}; restore the files saved together")
        model.load_state_dict(sd, strict=False)
        return model.eval()
