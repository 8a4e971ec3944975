"""Tokenizer and the Gemma-4 prompt layout (policy.md "Prompt"; model.md 6.4, 7).

Control tokens are always inserted as ids looked up by name, never hard-coded, never spelled in text:
user text is encoded with special tokens split (`encode_special_tokens`), so a user who types
"<turn|>" gets those characters, not the control token. `make_demo_tokenizer` writes the tiny demo
model's tokenizer: a byte-level BPE carrying Gemma-4's special tokens by name, so the engine cannot
tell it from the real one.
"""
from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer

# Gemma-4's control tokens (model.md 7). The demo has all of them, in this order from id 0.
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|think|>", "<|channel>",
            "<channel|>", "<|image>", "<|image|>", "<image|>", "<|tool>", "<tool|>", "<|tool_call>",
            "<tool_call|>", '<|"|>', "<|video|>", "<|audio|>")
# The ones a stem or the policy uses; Prompter refuses a tokenizer that lacks any of them.
NEEDED = ("<bos>", "<eos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
          "<|image>", "<|image|>", "<image|>")
LETTERS = tuple(chr(ord("A") + i) for i in range(26))
INSTRUCTION = "Answer with the letter of one option."


class PromptError(ValueError):
    """A tokenizer that cannot express the prompt layout, or arguments that do not fit it."""


# --- demo tokenizer -------------------------------------------------------------------------------

DEMO_VOCAB = 512  # sizes the demo model's embedding: 19 specials + 256 bytes + 237 merged tokens
# Words the demo BPE merges into one token each, prompt words first, exactly filling DEMO_VOCAB
# (ByteLevel spelling: "Ġ" is a leading space). Chains are built right to left, so the only merge with
# "Ġ" on its left joins it to a whole word of 2+ letters: " A" stays "Ġ" "A", and "\n" is always its
# own pre-token, so a key letter is its own token after " " or "\n" too.
_WORDS = """system user model thought Options Answer Ġwith Ġthe Ġletter Ġof Ġone Ġoption Ġand Ġto
Ġin Ġis Ġthat Ġfor Ġit Ġas Ġwas Ġon Ġbe Ġby Ġare Ġthis Ġfrom Ġat Ġor Ġwhich Ġwhat Ġnot
Ġyou Ġhave Ġan Ġthey Ġwe Ġhis Ġher Ġcan Ġall Ġthere Ġwere Ġwhen Ġyour Ġwill Ġeach Ġabout
Ġhow Ġup Ġout Ġthem Ġthen Ġshe Ġmany Ġsome Ġso Ġthese Ġwould Ġother Ġinto Ġhas Ġmore
Ġtime Ġcould Ġno Ġmake Ġthan Ġfirst Ġwater Ġcolour Ġlight Ġred Ġgreen Ġblue Ġyes
Ġquestion Ġimage Ġtext Ġshow Ġpeople Ġour
""".split()


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits), by byte."""
    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}
    spare = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(spare)) for b in range(256)]


def _bpe(word: str, ranks: dict) -> list[str]:
    """What the tokenizers BPE model does to one pre-token: merge the lowest-ranked pair (leftmost on
    ties) until no pair has a merge."""
    syms = list(word)
    while len(syms) > 1:
        rank, i = min((ranks.get(p, len(ranks)), i) for i, p in enumerate(zip(syms, syms[1:])))
        if rank == len(ranks):
            break
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    return syms


def make_demo_tokenizer(out_dir: str) -> int:
    """Write tokenizer.json and tokenizer_config.json for the demo model into out_dir; returns the
    vocab size. Written as JSON directly (not via Tokenizer.save), so the bytes depend on nothing but
    this code. Merges are built, not trained: for each word, merge the last two pieces that BPE
    leaves until the word is one token, so every listed word really encodes to one token."""
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for c in _byte_chars():
        vocab[c] = len(vocab)
    ranks: dict[tuple[str, str], int] = {}
    for word in _WORDS:
        while len(vocab) < DEMO_VOCAB and len(pieces := _bpe(word, ranks)) > 1:
            ranks[pieces[-2], pieces[-1]] = len(ranks)
            vocab.setdefault(pieces[-2] + pieces[-1], len(vocab))
    assert len(vocab) == DEMO_VOCAB, "extend _WORDS"
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, s in enumerate(SPECIALS)],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [list(p) for p in ranks]},
    }
    # Like Gemma's: no BOS added on encode (we insert it), chat tokens named as transformers names them.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 131072,
              "boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>"}
    os.makedirs(out_dir, exist_ok=True)
    for name, obj in (("tokenizer.json", tok), ("tokenizer_config.json", config)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8", newline="\n") as f:
            f.write(json.dumps(obj, ensure_ascii=False, indent=1) + "\n")
    return len(vocab)


# --- prompts --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stem:
    tokens: tuple[int, ...]                   # up to and including "<|channel>thought\n"
    shared_len: int                           # tokens[:shared_len]: the same for every question of a request
    image_spans: tuple[tuple[int, int], ...]  # (start, count) of each <|image|> run; request images first
    keys: tuple[int, ...]                     # key ids of this question's choices, A first


class Prompter:
    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:                          # tokenizers raises a bare Exception: missing, not JSON, ...
            raise PromptError(f"{path}: cannot read the tokenizer: {e}") from None
        self._ids = {}
        for name in NEEDED:
            if (i := self.tok.token_to_id(name)) is None:
                raise PromptError(f"{path}: special token {name} not found")
            self._ids[name] = i
        # encode_special_tokens splits only tokens marked special: a control token the file marks as
        # ordinary would still be matched inside user text, so mark it special (keeping its flags).
        fix = [AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                          normalized=t.normalized, special=True)
               for t in self.tok.get_added_tokens_decoder().values()
               if t.content in SPECIALS and not t.special]
        if fix:
            self.tok.add_special_tokens(fix)
        self.tok.encode_special_tokens = True
        control = set(self._ids.values())
        for name in NEEDED:
            if control & set(self.encode(name)):
                raise PromptError(f"{path}: the text {name!r} encodes to a control token")
        keys = []
        for letter in LETTERS:
            if len(ids := self.encode(letter)) != 1:
                raise PromptError(f"{path}: option key {letter} is {len(ids)} tokens, not one")
            keys.append(ids[0])
        self.keys: tuple[int, ...] = tuple(keys)  # ids of A..Z
        self.channel_close = self._ids["<channel|>"]
        self.eos_ids = (self._ids["<eos>"], self._ids["<turn|>"])
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self._shared_memo = None                 # (key, tokens, spans) of stem's last shared part

    def id(self, name: str) -> int:
        if (i := self.tok.token_to_id(name)) is None:
            raise PromptError(f"token {name} not in the tokenizer")
        return i

    def encode(self, text: str) -> list[int]:
        """Plain text to ids: no BOS, and special-token spellings stay text."""
        return self.tok.encode(text, add_special_tokens=False).ids if text else []

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids) -> str:
        """Ids to text, special tokens rendered by name."""
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def stem(self, system: str, context: str, request_images, question_text: str, choices,
             question_images) -> Stem:
        """The policy.md prompt up to and including "<|channel>thought\\n"; images as soft-token counts.

        Segmentation: control tokens and image runs are inserted as ids; the text between two of them
        is encoded as one piece, except for one forced cut right after the context. The shared part
        (system turn, "user\\n", request images, context) therefore encodes the same whatever the
        question, and `shared_len` ends there; the question part starts with "\\n\\n" (joined to the
        question text when the question has no images)."""
        if not 1 <= len(choices) <= len(self.keys):
            raise PromptError(f"{len(choices)} choices; between 1 and {len(self.keys)} fit the keys")
        options = "".join(f"\n{k}. {c}" for k, c in zip(LETTERS, choices))
        i = self._ids
        runs = [self._image(n) for n in request_images]
        key = (system, context, tuple(len(r) for r in runs))
        memo = self._shared_memo                 # the last shared part: a request's questions share it
        if memo is not None and memo[0] == key:
            tokens, spans = list(memo[1]), list(memo[2])
        else:
            shared = [[i["<bos>"], i["<|turn>"]], "system\n", [i["<|think|>"]], system, [i["<turn|>"]], "\n",
                      [i["<|turn>"]], "user\n", *runs, context]
            tokens, spans = [], []
            self._emit(shared, tokens, spans)
            self._shared_memo = (key, tuple(tokens), tuple(spans))
        shared_len = len(tokens)
        question = ["\n\n", *map(self._image, question_images),
                    f"{question_text}\n\nOptions:{options}\n\n{INSTRUCTION}", [i["<turn|>"]], "\n",
                    [i["<|turn>"]], "model\n", [i["<|channel>"]], "thought\n"]
        self._emit(question, tokens, spans)
        return Stem(tuple(tokens), shared_len, tuple(spans), self.keys[:len(choices)])

    def _emit(self, pieces, tokens, spans):
        """Append pieces: text (str, adjacent ones encoded together), control ids (list) or an image
        run (tuple: <|image>, n x <|image|>, <image|>, whose (start, n) goes to spans)."""
        text = ""
        for piece in pieces + [[]]:  # the empty sentinel flushes the last text
            if isinstance(piece, str):
                text += piece
                continue
            tokens += self.encode(text)
            text = ""
            if isinstance(piece, tuple):
                spans.append((len(tokens) + 1, len(piece) - 2))
            tokens += piece

    def _image(self, n: int) -> tuple[int, ...]:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise PromptError(f"an image needs a positive soft-token count, got {n!r}")
        n = int(n)  # numpy ints from vision are fine
        return (self._ids["<|image>"], *[self._ids["<|image|>"]] * n, self._ids["<image|>"])
