"""IncrementalDetokenizer on real tokenizers trained in-process (no download).

Two decoders whose single-token decodes are wrong in different ways:
- byte-level BPE (GPT-2 / Llama-3 / SmolLM2 style) with a vocabulary so small that emoji and
  CJK characters are split over several tokens;
- SentencePiece-style BPE with byte fallback (Llama-2 style): `<0xF0>`-like byte tokens and a
  decoder that strips the leading space of the first token.
"""
import functools
import json

from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ferrum.tokenizer.detokenizer import IncrementalDetokenizer
from tiny_models import byte_level_bpe

CORPUS = ["Hello world, this is a test.", "The quick brown fox jumps over the lazy dog.",
          "日本語のテキスト", "emoji 😀 and 🎉 party", "café naïve"] * 3


class HfWrapper:
    """The part of ferrum's Tokenizer the detokenizer uses; records decoded window sizes."""

    def __init__(self, hf):
        self.hf = hf
        self.window_sizes = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text):
        return self.hf.encode(text, add_special_tokens=False)


@functools.cache
def byte_level() -> HfWrapper:
    tok = byte_level_bpe(CORPUS, 300, ["<|eos|>"])
    return HfWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>"))


@functools.cache
def byte_fallback() -> HfWrapper:
    # Merges learnt on ASCII text; every other character falls back to its UTF-8 byte tokens.
    ascii_bpe = Tokenizer(models.BPE())
    ascii_bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    ascii_bpe.train_from_iterator(CORPUS[:2], trainers.BpeTrainer(vocab_size=120,
                                                                   show_progress=False))
    vocab = {"<unk>": 0, "</s>": 1} | {f"<0x{b:02X}>": 2 + b for b in range(256)}
    for piece in sorted(ascii_bpe.get_vocab(), key=ascii_bpe.get_vocab().get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in json.loads(ascii_bpe.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return HfWrapper(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                                             unk_token="<unk>"))


def stream(tok, prompt_ids, output_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    deltas = [detok.add(t) for t in output_ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


TEXT = "Hello 😀 world 日本語 café 🎉 the lazy dog"


def test_emoji_split_over_tokens_comes_out_whole():
    tok = byte_level()
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) > 1, "the test needs an emoji split over several tokens"
    assert all(tok.hf.decode([t]).endswith("\ufffd") for t in emoji_ids)
    deltas, tail = stream(tok, tok.encode("A"), tok.encode("x😀y"))
    assert deltas == ["x"] + [""] * (len(emoji_ids) - 1) + ["😀", "y"]
    assert tail == ""


def test_byte_fallback_emoji_and_leading_space():
    tok = byte_fallback()
    ids = tok.encode("lazy 😀")          # "▁lazy" "▁" <0xF0> ...
    assert [tok.hf.convert_ids_to_tokens(t) for t in ids[-4:]] == [
        "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    # Single-token decodes lose the space before "lazy"; the windowed diff keeps it.
    assert tok.hf.decode(ids[:1]) == "lazy"
    deltas, _ = stream(tok, tok.encode("the"), ids)
    assert deltas[0] == " lazy"
    assert deltas[-4:] == ["", "", "", "😀"]


def test_deltas_concatenate_to_full_decode_for_both_tokenizers():
    for tok in (byte_level(), byte_fallback()):
        prompt, output = tok.encode("The quick"), tok.encode(" " + TEXT)
        deltas, tail = stream(tok, prompt, output)
        full = tok.hf.decode(prompt + output)
        assert "".join(deltas) + tail == full[len(tok.hf.decode(prompt)):]
        assert tail == "" and not any("\ufffd" in d for d in deltas)


def test_no_prompt():
    tok = byte_level()
    deltas, _ = stream(tok, [], tok.encode(TEXT))
    assert "".join(deltas) == TEXT


def test_special_tokens_skipped_or_kept():
    tok = byte_level()
    eos = tok.hf.eos_token_id
    ids = tok.encode("Hello") + [eos] + tok.encode(" 😀")
    assert "".join(stream(tok, [], ids)[0]) == "Hello 😀"
    assert "".join(stream(tok, [], ids, skip_special_tokens=False)[0]) == "Hello<|eos|> 😀"


def test_incomplete_character_at_end_is_dropped():
    """A sequence cut inside a character (max_tokens) ends with the last whole character, not
    with U+FFFD (issue 19 item 7); the space before it stays."""
    for tok in (byte_level(), byte_fallback()):
        prompt, full = tok.encode("A"), tok.encode("ok 😀")
        ids = full[:-1]                       # the emoji's last byte is missing
        assert tok.hf.decode(ids).endswith("\ufffd")
        deltas, tail = stream(tok, prompt, ids)
        whole = tok.hf.decode(prompt + full)[len(tok.hf.decode(prompt)):]
        assert "".join(deltas) + tail == whole.removesuffix("😀") and whole.endswith(" 😀")


def test_decode_window_stays_small():
    """Byte-level BPE streams through a UTF-8 decoder (no decode call at all); other
    tokenizers decode windows of at most 2 * 4 tokens."""
    for tok, most in ((byte_level(), None), (byte_fallback(), 8)):
        prompt, ids = tok.encode("prompt " * 50), tok.encode(TEXT * 20)
        tok.window_sizes.clear()
        detok = IncrementalDetokenizer(tok, prompt)
        for t in ids:
            detok.add(t)
        sizes = list(tok.window_sizes)
        assert detok.text == tok.hf.decode(prompt + ids)[len(tok.hf.decode(prompt)):]
        assert detok.text.strip() == TEXT * 20 and len(ids) > 300
        tok.window_sizes[:] = sizes
        assert (tok.window_sizes == [] if most is None else max(tok.window_sizes) <= most)


class DecodeOnly:
    """A tokenizer that offers nothing but decode: no byte information."""

    def __init__(self, wrapper: HfWrapper):
        self.decode = wrapper.decode


def test_genuine_replacement_characters_stream_at_once_in_constant_time(smollm2_tokenizer):
    """Issue 13 item 6: the model generating U+FFFD itself (SmolLM2's token 24211, forced with
    logit_bias) held back all text until the end, and decoded an ever longer window: 6,000
    such tokens took 8 s. Now each one streams at once and no decode grows."""
    smol = HfWrapper(smollm2_tokenizer.hf)
    (fffd,) = smol.encode("\ufffd")
    cases = [(smol, [fffd], 1), (byte_level(), byte_level().encode("\ufffd"), 1),
             (byte_fallback(), byte_fallback().encode("\ufffd")[-3:], 1),
             (DecodeOnly(byte_level()), byte_level().encode("\ufffd"), 4)]
    for tok, char_ids, lag in cases:
        wrapper = tok if isinstance(tok, HfWrapper) else byte_level()
        wrapper.window_sizes.clear()
        n = 2000 if tok is not smol else 6000
        deltas, tail = stream(tok, wrapper.encode("x"), char_ids * n)
        assert "".join(deltas) + tail == "\ufffd" * n
        per_char = len(char_ids)
        # a character's text comes out with its last token (bounded lag without byte info)
        assert all(d == "" for d in deltas[:per_char - 1])
        assert "".join(deltas[:per_char * lag]) != ""
        assert max(wrapper.window_sizes, default=0) <= 9
        assert sum(wrapper.window_sizes) <= 10 * len(deltas)


def test_skipped_special_tokens_do_not_grow_the_window():
    """Tokens that decode to nothing (special tokens skipped, e.g. EOS forced with ignore_eos)
    grew the decode window with every one of them."""
    tok = byte_fallback()
    eos = tok.hf.eos_token_id
    tok.window_sizes.clear()
    deltas, tail = stream(tok, tok.encode("x"), tok.encode("a") + [eos] * 2000 + tok.encode(" b"))
    assert "".join(deltas) + tail == tok.hf.decode(tok.encode("x") + tok.encode("a") + tok.encode(" b"),
                                                   skip_special_tokens=True)[len(tok.hf.decode(tok.encode("x"))):]
    assert max(tok.window_sizes) <= 9


ALPHABET = st.sampled_from(list("abc xyz.,") + ["😀", "🎉", "日", "本", "é", "ï", "🤖", "\n"])


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(ALPHABET, max_size=6).map("".join),
       text=st.lists(ALPHABET, min_size=1, max_size=30).map("".join))
def test_streaming_matches_one_shot_decode(prompt, text):
    for tok in (byte_level(), byte_fallback()):
        prompt_ids, ids = tok.encode(prompt), tok.encode(text)
        deltas, tail = stream(tok, prompt_ids, ids)
        assert tail == "" and not any("\ufffd" in d for d in deltas)
        full = tok.hf.decode(prompt_ids + ids)
        assert "".join(deltas) == full[len(tok.hf.decode(prompt_ids)):]


def test_prompt_ending_inside_a_character():
    """A token-id prompt cut inside a character: the output that completes it starts with the
    whole character (not U+FFFD and a stray byte); one that does not complete it starts with
    its own text, the prompt's orphan bytes dropped."""
    for tok in (byte_level(), byte_fallback()):
        ok, emoji, rest = tok.encode("ok"), tok.encode("😀"), tok.encode(" yes")
        prompt = ok + emoji[:-1]              # the emoji's last byte is in the output
        whole = tok.hf.decode(ok + emoji + rest)
        from_emoji = whole[whole.index("😀"):]
        deltas, tail = stream(tok, prompt, emoji[-1:] + rest)
        assert "".join(deltas) + tail == from_emoji, tok
        deltas, tail = stream(tok, prompt, rest)
        assert "".join(deltas) + tail == from_emoji.removeprefix("😀"), tok
    tok = byte_level()   # (byte fallback decodes every byte of an invalid run to U+FFFD)
    prompt = tok.encode("ok") + tok.encode("😀")[:-1]
    deltas, tail = stream(tok, prompt, tok.encode("\ufffd yes"))
    assert "".join(deltas) + tail == "\ufffd yes"            # a genuine U+FFFD stays
