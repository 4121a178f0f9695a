"""Writes the testbed model: a random-weight llama-architecture GGUF with a GPT-2 style byte-level
tokenizer and a ChatML template, plus a LoRA adapter for it. Deterministic for a seed, and shaped so
that every sampled token is printable ASCII (one stream event per token, no early end of text)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import gguf
import numpy as np
import numpy.typing as npt

ARCH = "llama"
VOCAB_SIZE = 4096  # padded like real models; also what the measured speeds in testbed.md used
CONTEXT_LENGTH = 32768  # the server's -c picks the real size; this only has to be big enough
LORA_RANK = 8
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
"""Fill-in-the-middle markers, so that llama-server serves `/infill` with the testbed model."""
FIM_KEYS = (gguf.Keys.Tokenizer.FIM_PRE_ID, gguf.Keys.Tokenizer.FIM_SUF_ID,
            gguf.Keys.Tokenizer.FIM_MID_ID)
# Common English letter pairs, and a space ('Ġ' in GPT-2 spelling) before common initials.
LETTER_PAIRS = (
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed",
    "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le", "ve", "co",
    "me", "de", "hi", "ri", "ro", "ic", "ne", "ea", "ra", "ce", "li", "ch", "ll", "be", "ma", "si",
)  # fmt: skip
SPACE_INITIALS = "tasowicbpfmdhrlneg"
# Logit spread of the printable tokens: far above the 0 of the zeroed rows, so those never win.
OUTPUT_LOGIT_STD = 10.0

Array = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Preset:
    embd: int
    layers: int
    heads: int
    ff: int


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "tiny": Preset(embd=256, layers=4, heads=4, ff=768),
        "small": Preset(embd=768, layers=8, heads=12, ff=2048),
    }
)


@dataclass(frozen=True)
class ModelFiles:
    model: Path
    lora: Path


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    printable: list[int]  # ids that may be sampled
    eos: int
    bos: int


def write_model(directory: Path | str, preset: str = "tiny", seed: int = 0) -> ModelFiles:
    """Write `<preset>-s<seed>.gguf` and its `-lora.gguf` adapter into `directory`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (valid: {', '.join(PRESETS)})")
    shape = PRESETS[preset]
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab()
    rng = np.random.default_rng(seed)
    files = ModelFiles(
        model=folder / f"slotwise-{preset}-s{seed}.gguf",
        lora=folder / f"slotwise-{preset}-s{seed}-lora.gguf",
    )
    _write_atomically(files.model, lambda path: _write_base(path, shape, vocab, rng))
    _write_atomically(files.lora, lambda path: _write_lora(path, shape, rng))
    return files


def build_vocab() -> Vocab:
    spelling = gpt2_byte_spelling()
    tokens = [spelling[byte] for byte in range(256)]
    pairs = [(pair[0], pair[1]) for pair in LETTER_PAIRS]
    pairs += [(spelling[0x20], initial) for initial in SPACE_INITIALS]
    merges = [f"{a} {b}" for a, b in pairs]
    tokens += [a + b for a, b in pairs]
    printable = sampled_bytes(spelling, pairs)
    eos = len(tokens) + CONTROL_TOKENS.index("<|im_end|>")
    bos = len(tokens) + CONTROL_TOKENS.index("<|endoftext|>")
    control = (*CONTROL_TOKENS, *FIM_TOKENS)
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(control)
    tokens += control
    padding = VOCAB_SIZE - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(padding)]
    types += [gguf.TokenType.UNUSED] * padding
    return Vocab(tokens, [int(t) for t in types], merges, printable, eos, bos)


def sampled_bytes(spelling: Mapping[int, str], pairs: Sequence[tuple[str, str]]) -> list[int]:
    """The tokens the model may sample: the printable ASCII bytes that no merge joins (a space may
    come, the initials it merges with may not). A reply then tokenizes back to the ids it was
    generated as, as a trained model's canonical tokens do: sampled from every byte and merge, the
    random model spelt "t" "h" where the tokenizer reads "th", and a follow-up found 3 of 8 of its
    replies whole in the slot's cache (a 60-token reply, the small model)."""
    merged = {part for pair in pairs for part in pair} - {spelling[0x20]}
    return [byte for byte in range(0x20, 0x7F) if spelling[byte] not in merged]


def gpt2_byte_spelling() -> dict[int, str]:
    """GPT-2's byte-to-unicode map: printable bytes stand for themselves, the rest shift to 256+."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    spelling = {byte: chr(byte) for byte in kept}
    shifted = (byte for byte in range(256) if byte not in spelling)
    for offset, byte in enumerate(shifted):
        spelling[byte] = chr(256 + offset)
    return spelling


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    # Readers (a server started by a parallel test) never see a half-written file.
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(staging)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def _write_base(path: Path, shape: Preset, vocab: Vocab, rng: np.random.Generator) -> None:
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_name(f"slotwise testbed {path.stem}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _add_hparams(writer, shape)
    _add_tokenizer(writer, vocab)
    for name, tensor in _base_tensors(shape, vocab, rng):
        writer.add_tensor(name, tensor)
    _finish(writer)


def _add_hparams(writer: gguf.GGUFWriter, shape: Preset) -> None:
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(shape.embd)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.embd // shape.heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB_SIZE)


def _add_tokenizer(writer: gguf.GGUFWriter, vocab: Vocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    for key, token in zip(FIM_KEYS, FIM_TOKENS, strict=True):
        writer.add_uint32(key, vocab.tokens.index(token))
    writer.add_chat_template(CHAT_TEMPLATE)


def _base_tensors(
    shape: Preset, vocab: Vocab, rng: np.random.Generator
) -> Iterator[tuple[str, npt.NDArray[np.generic]]]:
    # Scales keep every layer's contribution to the residual stream about as large as the token
    # embedding, so the context (and the LoRA) changes which token comes next.
    e, f = shape.embd, shape.ff
    yield "token_embd.weight", _f16(_normal(rng, (VOCAB_SIZE, e), 1.0))
    for i in range(shape.layers):
        yield f"blk.{i}.attn_norm.weight", np.ones(e, dtype=np.float32)
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            yield f"blk.{i}.{part}.weight", _f16(_normal(rng, (e, e), e**-0.5))
        yield f"blk.{i}.ffn_norm.weight", np.ones(e, dtype=np.float32)
        yield f"blk.{i}.ffn_gate.weight", _f16(_normal(rng, (f, e), e**-0.5))
        yield f"blk.{i}.ffn_up.weight", _f16(_normal(rng, (f, e), e**-0.5))
        yield f"blk.{i}.ffn_down.weight", _f16(_normal(rng, (e, f), f**-0.5))
    yield "output_norm.weight", np.ones(e, dtype=np.float32)
    yield "output.weight", _f16(_output_matrix(rng, e, vocab.printable))


def _output_matrix(rng: np.random.Generator, embd: int, printable: list[int]) -> Array:
    # A zero row gives logit 0; the printable rows are scaled so their best logits sit far above.
    out = np.zeros((VOCAB_SIZE, embd), dtype=np.float32)
    out[printable] = _normal(rng, (len(printable), embd), OUTPUT_LOGIT_STD * embd**-0.5)
    return out


def _write_lora(path: Path, shape: Preset, rng: np.random.Generator) -> None:
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(LORA_RANK))  # alpha/rank = 1
    e = shape.embd
    for i in range(shape.layers):
        for part in ("attn_q", "attn_v"):
            # B·A is as large as the weight it adapts: a visible change at scale 1.
            lora_a = _normal(rng, (LORA_RANK, e), e**-0.5)
            lora_b = _normal(rng, (e, LORA_RANK), LORA_RANK**-0.5)
            writer.add_tensor(f"blk.{i}.{part}.weight.lora_a", lora_a)
            writer.add_tensor(f"blk.{i}.{part}.weight.lora_b", lora_b)
    _finish(writer)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _normal(rng: np.random.Generator, shape: tuple[int, int], std: float) -> Array:
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _f16(values: Array) -> npt.NDArray[np.float16]:
    return values.astype(np.float16)
