"""Small Qwen3-format checkpoints built offline: a locally trained tokenizer and a random model.

Tests and ``:tiny`` experiment variants need a Hugging Face Qwen3 directory without a network:
:func:`train_tokenizer` trains a byte-level BPE shaped like Qwen3's (same normaliser,
pre-tokeniser regex, byte alphabet and added tokens in Qwen3's order, appended after the
learned vocabulary as Qwen3 does); :func:`write_tiny_qwen3` writes config.json, safetensors,
tokenizer.json, tokenizer_config.json and generation_config.json from a random init of Gyre's
decoder. Neither needs torch or transformers.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import os
import random
import shutil
import tempfile

import jax
import numpy as np
from flax import nnx
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from gyre.model import decoder, hf
from gyre.model.safetensors_io import write_folder, write_json

# Qwen3's added tokens in its id order (151643..151668), with its `special` flag: the tool and
# think markers are added (never split) but not special, so decoding with
# skip_special_tokens=True keeps them, as in Qwen3.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
EOS_TOKEN = "<|im_end|>"  # ends an assistant turn (tokenizer_config eos_token)
PAD_TOKEN = "<|endoftext|>"  # also the document end; generation stops on both
# Qwen3's pre-tokeniser split (tokenizer.json), before the byte-level mapping.
QWEN3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The smallest vocabulary: every byte plus the added tokens.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def _load_template() -> str:
    text = importlib.resources.files("gyre.model").joinpath("qwen3_chat_template.jinja")
    # The file ends with a newline for editors; Qwen3's template string does not.
    return text.read_text(encoding="utf-8").removesuffix("\n")


# Qwen3's chat template as shipped in its tokenizer_config.json (the hybrid-thinking one:
# tools in the system turn, <tool_call> JSON, tool results as user turns, enable_thinking).
QWEN3_CHAT_TEMPLATE: str = _load_template()


_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact be have do say get make go know "
    "take see come think look want give use find tell ask seem feel try leave call good new "
    "first last long great little own other old right big high different small large next "
    "early young important few public bad same able to of in for on with at by from up about "
    "into over after beneath under above the and a that I it not he as you this but his they "
    "her she or an will my one all would there their what so out if who which go me when "
    "value result index count total list dict string integer float return yield import class "
    "lambda while break continue assert raise except finally try pass none true false self "
    "path file test tests output input error message function tool call response answer score "
    "parse render token tokens model train step loss reward policy sample batch shard config"
)


def _builtin_corpus() -> list[str]:
    """Deterministic English, Python, JSON and chat-format text for training the BPE."""
    english = [
        "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
        "You may call one or more functions to assist with the user query.",
        "Write a function that returns the sum of the numbers in a list, then run the tests.",
        "The answer is 42. Let me think about it step by step before I answer.",
        "Read the file, fix the failing test, and explain what was wrong in one sentence.",
        "All tests passed. The program printed the expected output and exited with code 0.",
        "Error: the file does not exist. Please check the path and try again.",
    ]
    python = [
        "def add(a, b):\n    return a + b\n",
        "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv[1:]:\n        print(name)\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
        "    def push(self, x):\n        self.items.append(x)\n",
        "if __name__ == '__main__':\n    assert add(2, 3) == 5, 'add is broken'\n",
        "with open('solution.py', 'w') as f:\n    f.write(source)\n",
        "for i in range(10):\n    if i % 2 == 0:\n        continue\n    total += i * i\n",
    ]
    records = [
        {"name": "write_file", "arguments": {"path": "solution.py", "content": "x = 1\n"}},
        {"name": "run_tests", "arguments": {}},
        {"name": "read_file", "arguments": {"path": "tests/test_solution.py"}},
        {"type": "function", "function": {"name": "calculator", "parameters": {"a": 1.5}}},
        {"answer": [1, 2, 3], "ok": True, "error": None, "score": 0.75},
    ]
    chat = [f"<tool_call>\n{json.dumps(r)}\n</tool_call>" for r in records] + [
        "<tool_response>\nok\n</tool_response>",
        "<think>\nThe user wants the sum.\n</think>\n\nThe sum is 10.",
    ]
    texts = english + python + [json.dumps(r, indent=2) for r in records] + chat
    # Numbers, punctuation and some non-ASCII so merges cover them too.
    texts += [" ".join(str(i * 37 % 1000) for i in range(k, k + 40)) for k in range(0, 400, 40)]
    texts += ["naïve café — 東京 Ελληνικά ✓ 😀 ü ß ñ"]
    # Seeded word salad and generated code: enough distinct words for a few thousand merges.
    rng = random.Random(0)
    words = " ".join(english).lower().replace(".", "").replace(",", "").split() + _WORDS.split()
    for _ in range(300):
        texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(6, 18))).capitalize())
    for i in range(150):
        name, arg = rng.choice(_WORDS.split()), rng.choice(_WORDS.split())
        texts.append(
            f'def {name}_{i}({arg}, n={i}):\n    """Return the {name} of {arg}."""\n'
            f"    result = [{arg}[k] * {i} for k in range(n)]\n    return result\n"
        )
        texts.append(json.dumps({"id": i, "name": name, "tags": [arg, name], "value": i / 7}))
    return texts * 2


def _qwen3_shaped_tokenizer() -> Tokenizer:
    """An empty BPE with Qwen3's normaliser, pre-tokeniser, post-processor and decoder."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def added_token(content: str, special: bool) -> AddedToken:
    """One added token with Qwen3's flags (never normalised, no stripping)."""
    return AddedToken(
        content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
    )


def train_tokenizer(vocab_size: int = 1024, corpus: list[str] | None = None) -> Tokenizer:
    """A Qwen3-shaped byte-level BPE of at most ``vocab_size`` tokens, trained on ``corpus``.

    The 256 byte symbols are always in the vocabulary, so any UTF-8 text encodes; the learned
    tokens come first and :data:`SPECIAL_TOKENS` follow in Qwen3's order. Deterministic for a
    given corpus. Fewer than ``vocab_size`` tokens result when the corpus runs out of merges.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is below {MIN_VOCAB} (256 bytes + added tokens)")
    corpus = tuple(_builtin_corpus() if corpus is None else corpus)
    # A fresh object per call (Tokenizer is mutable); training runs once per corpus.
    return Tokenizer.from_str(_trained_json(vocab_size, corpus))


@functools.lru_cache(maxsize=8)
def _trained_json(vocab_size: int, corpus: tuple[str, ...]) -> str:
    tok = _qwen3_shaped_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    # Appended in order after the learned vocabulary, as in Qwen3 (ids V_bpe, V_bpe+1, ...).
    for content, special in SPECIAL_TOKENS:
        if special:
            tok.add_special_tokens([added_token(content, True)])
        else:
            tok.add_tokens([added_token(content, False)])
    return tok.to_str()


def tokenizer_config(tokenizer: Tokenizer, chat_template: str = QWEN3_CHAT_TEMPLATE) -> dict:
    """tokenizer_config.json as transformers writes it for Qwen3 (ids from ``tokenizer``)."""
    decoder_entries = {}
    for content, special in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(content)
        if token_id is None:
            raise ValueError(f"tokenizer lacks the added token {content!r}")
        decoder_entries[str(token_id)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder_entries,
        "additional_special_tokens": [
            c for c, special in SPECIAL_TOKENS if special and c != PAD_TOKEN
        ],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def generation_config(tokenizer: Tokenizer) -> dict:
    """generation_config.json as Qwen3 ships it: stops on <|im_end|> and <|endoftext|>."""
    im_end, eot = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    return {
        "bos_token_id": eot,
        "do_sample": True,
        "eos_token_id": [im_end, eot],
        "pad_token_id": eot,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def random_params(spec: decoder.ModelSpec, seed: int) -> dict:
    """A random init of the decoder for ``spec`` as a float32 numpy dict shaped like
    ``nnx.to_pure_dict(state)``, drawn with numpy at the decoder's scales (embeddings 0.02,
    projections fan_in**-0.5, norm scales one).

    numpy rather than jax.random: compiling JAX's RNG for a dozen shapes costs seconds on a
    CPU, and numpy's stream is stable across versions, so a seed names the same checkpoint
    on every machine.
    """
    _, abstract = decoder.abstract_model(spec)
    shapes = jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(abstract))
    d, hd, f = spec.d_model, spec.num_heads * spec.head_dim, spec.d_ff
    fan_in = {"q": d, "k": d, "v": d, "o": hd, "gate": d, "up": d, "down": f, "lm_head": d}
    rng = np.random.default_rng(seed)

    def init(path, shape):
        name = path[-1].key
        if name == "embed":
            return (0.02 * rng.standard_normal(shape)).astype(np.float32)
        if name in fan_in:
            return (rng.standard_normal(shape) * fan_in[name] ** -0.5).astype(np.float32)
        return np.ones(shape, np.float32)  # norm scales

    return jax.tree.map_with_path(init, shapes, is_leaf=lambda x: isinstance(x, tuple))


def write_tiny_qwen3(
    path: str,
    spec: decoder.ModelSpec,
    seed: int = 0,
    vocab_size: int | None = None,
    max_shard_bytes: int | None = None,
    corpus: list[str] | None = None,
) -> str:
    """Writes a complete HF Qwen3 directory at ``path`` and returns ``path``.

    Weights: :func:`random_params` for ``spec`` and ``seed`` (float32). Tokenizer: trained
    locally with at most ``vocab_size`` tokens (default ``spec.vocab_size``, which must be at
    least :data:`MIN_VOCAB`); the model's vocabulary may be larger, as Qwen3's is. Weights
    are sharded with an index when larger than ``max_shard_bytes`` (default: one file).
    ``corpus``: the tokenizer's training text (default: :func:`train_tokenizer`'s own).
    """
    vocab_size = spec.vocab_size if vocab_size is None else vocab_size
    if vocab_size > spec.vocab_size:
        raise ValueError(
            f"tokenizer vocab_size={vocab_size} exceeds the model's vocab_size={spec.vocab_size}"
        )
    tokenizer = train_tokenizer(vocab_size, corpus)
    pure = random_params(spec, seed)
    os.makedirs(path, exist_ok=True)
    config = hf.config_to_hf(spec)
    config.update(
        bos_token_id=tokenizer.token_to_id(PAD_TOKEN),
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        rope_theta=float(spec.rope_theta),  # older transformers read this key
    )
    write_json(os.path.join(path, "config.json"), config)
    write_folder(path, hf.pure_to_hf(pure, spec), max_shard_bytes)
    write_tokenizer_files(path, tokenizer)
    return path


def write_tokenizer_files(
    path: str, tokenizer: Tokenizer, chat_template: str = QWEN3_CHAT_TEMPLATE
) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json for ``tokenizer``
    (one from :func:`train_tokenizer`) into the existing folder ``path``."""
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    config = tokenizer_config(tokenizer, chat_template)
    write_json(os.path.join(path, "tokenizer_config.json"), config)
    write_json(os.path.join(path, "generation_config.json"), generation_config(tokenizer))


def tiny_qwen3_path(root: str, spec: decoder.ModelSpec, seed: int = 0,
                    corpus: list[str] | None = None) -> str:  # fmt: skip
    """Where :func:`cached_tiny_qwen3` keeps (spec, seed, corpus)'s directory; writes
    nothing."""
    parts = [hf.config_to_hf(spec), seed, QWEN3_CHAT_TEMPLATE]
    if corpus is not None:  # only then: the default corpus keeps the names it always had
        parts.append(corpus)
    key = json.dumps(parts, sort_keys=True)
    return os.path.join(root, "qwen3-" + hashlib.sha256(key.encode()).hexdigest()[:16])


def cached_tiny_qwen3(root: str, spec: decoder.ModelSpec, seed: int = 0,
                      corpus: list[str] | None = None) -> str:  # fmt: skip
    """A :func:`write_tiny_qwen3` directory for (spec, seed) under ``root``, written once.

    Named by a hash of what it depends on (the HF config of ``spec``, the seed, the chat
    template), so every run of the same architecture shares one; written to a temporary
    folder first and renamed, so a crash never leaves half a checkpoint and two runs racing
    to make it both end up with the same files.
    """
    path = tiny_qwen3_path(root, spec, seed, corpus)
    if os.path.isdir(path):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        write_tiny_qwen3(tmp, spec, seed, corpus=corpus)
        os.rename(tmp, path)
    except OSError:
        if not os.path.isdir(path):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
