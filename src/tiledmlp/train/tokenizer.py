"""The presets' tokenizer: UTF-8 bytes as token ids, as a Hugging Face fast tokenizer.

Ids 0..255 are the bytes of the UTF-8 text, 256 is BOS, 257 is EOS (also the padding token);
vocabulary 258. Built from the `tokenizers` library that transformers already brings (a BPE
model with no merges over the byte-level alphabet), so `save_pretrained` writes a
tokenizer.json that `AutoTokenizer.from_pretrained` loads with nothing else installed, and an
output directory of `tiledmlp train` works as `--model` again.

Chat records (`--data` with "messages") go through CHAT_TEMPLATE: one "role: content" line per
turn between BOS and EOS, so a preset trains on chat data as on text.

Invariant: encode(text) == [256, *text.encode("utf-8"), 257], and decode inverts it.
"""

from __future__ import annotations

from typing import Any

from tiledmlp.models.presets import BYTE_VOCAB_SIZE

__all__ = ["BOS_ID", "CHAT_TEMPLATE", "EOS_ID", "VOCAB_SIZE", "byte_tokenizer"]

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = BYTE_VOCAB_SIZE
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for turn in messages %}{{ turn['role'] }}: {{ turn['content'] }}\n"
    "{% endfor %}{{ eos_token }}"
)


def byte_tokenizer() -> Any:
    """A PreTrainedTokenizerFast with the byte-level ids described above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to one printable character; give that character the id b.
    byte_char = _bytes_to_chars()
    vocab = {byte_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    vocab.update({"<s>": BOS_ID, "</s>": EOS_ID})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        model_max_length=2**31 - 1,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _bytes_to_chars() -> dict[int, str]:
    """The byte -> character table of the byte-level pre-tokenizer (printable bytes map to
    themselves, the others to code points from 256 up, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
