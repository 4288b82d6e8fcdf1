"""The tokenizer side of a Hugging Face checkpoint directory: read and cross-checked.

tokenizer.json (read with the ``tokenizers`` library); tokenizer_config.json (chat template,
eos/pad tokens) or a chat_template.jinja beside it; generation_config.json (stop ids). The
chat template stays text here: gyre.chat compiles it, and names :attr:`TokenizerFiles.
template_source` when it does not compile.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from tokenizers import Tokenizer

from gyre.model.safetensors_io import fail, read_json, write_json

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.50 saves the template here
GENERATION_CONFIG = "generation_config.json"
# Copied verbatim from a source checkpoint when saving.
FILES = (
    TOKENIZER,
    TOKENIZER_CONFIG,
    CHAT_TEMPLATE_FILE,
    GENERATION_CONFIG,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    """What a checkpoint's tokenizer-side files say.

    ``tokenizer``: tokenizer.json. ``chat_template``: Jinja source, read from
    ``template_source`` (a file, or tokenizer_config.json's field). ``stop_ids``:
    generation_config.json's eos_token_id(s), in its order. ``pad_id``: tokenizer_config.json's
    pad_token (else generation_config's pad_token_id, else the first stop id).
    """

    tokenizer: Tokenizer
    chat_template: str
    template_source: str
    stop_ids: tuple[int, ...]
    pad_id: int

    @property
    def num_tokens(self) -> int:
        """Token ids the tokenizer can produce: 0 .. num_tokens-1."""
        return tokenizer_size(self.tokenizer)


def has_tokenizer(folder: str) -> bool:
    """Whether ``folder`` has a tokenizer side (else it holds weights only)."""
    return os.path.isfile(os.path.join(folder, TOKENIZER))


def tokenizer_size(tok: Tokenizer) -> int:
    """1 + the largest id the tokenizer knows (added tokens included)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def read(folder: str, model_vocab: int) -> TokenizerFiles:
    """The tokenizer side of ``folder``, checked against the model's ``model_vocab`` ids;
    CheckpointError (one line: file, field, problem) on anything missing or inconsistent."""
    tok_path = os.path.join(folder, TOKENIZER)
    try:
        tokenizer = Tokenizer.from_file(tok_path)
    except Exception as e:  # the Rust side raises plain Exception
        raise fail(tok_path, f"not a tokenizers file ({e})") from e
    if not tokenizer.get_vocab(with_added_tokens=True):
        raise fail(tok_path, "the vocabulary is empty")
    n_tok = tokenizer_size(tokenizer)
    if n_tok > model_vocab:
        raise fail(
            tok_path,
            f"tokenizer ids reach {n_tok - 1}, beyond config.json vocab_size={model_vocab}",
        )

    tok_config_path = os.path.join(folder, TOKENIZER_CONFIG)
    tok_config = read_json(tok_config_path)
    template, template_source = _read_chat_template(folder, tok_config)
    ids = {}
    for field in ("eos_token", "pad_token"):
        value = tok_config.get(field)
        if value is None:
            continue
        name = _token_name(value)
        if name is None or tokenizer.token_to_id(name) is None:
            raise fail(tok_config_path, f"{field}={value!r} is not a token of {TOKENIZER}")
        ids[field] = tokenizer.token_to_id(name)

    stop_ids, gen = _read_stop_ids(folder, n_tok)
    pad_id = ids.get("pad_token", gen.get("pad_token_id"))
    if pad_id is None:
        pad_id = stop_ids[0]
    if not _is_int(pad_id) or not 0 <= pad_id < n_tok:
        raise fail(
            os.path.join(folder, GENERATION_CONFIG),
            f"pad_token_id={pad_id!r} is not an id below the tokenizer's {n_tok} tokens",
        )
    return TokenizerFiles(tokenizer, template, template_source, stop_ids, pad_id)


def _token_name(value) -> str | None:
    """tokenizer_config.json token fields are a string or {"content": ...} (older files)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _read_chat_template(folder: str, tok_config: dict) -> tuple[str, str]:
    """(template, where it was read) from chat_template.jinja if present (transformers prefers
    it), else tokenizer_config.json's chat_template: a string, or a list of {"name",
    "template"} from which "default" is taken."""
    jinja_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    cfg_path = os.path.join(folder, TOKENIZER_CONFIG)
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), jinja_path
    template = tok_config.get("chat_template")
    if template is None:
        raise fail(cfg_path, f"no chat_template field (and no {CHAT_TEMPLATE_FILE})")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise fail(
                cfg_path, f"chat_template list has no 'default' entry (names: {sorted(named)})"
            )
        template = named["default"]
    if not isinstance(template, str):
        raise fail(cfg_path, f"chat_template is {type(template).__name__}, not a string")
    return template, f"{cfg_path} field chat_template"


def _read_stop_ids(folder: str, n_tok: int) -> tuple[tuple[int, ...], dict]:
    """generation_config.json's eos_token_id(s), each a token id, and the whole file."""
    path = os.path.join(folder, GENERATION_CONFIG)
    gen = read_json(path)
    eos = gen.get("eos_token_id")
    ids = [eos] if _is_int(eos) else eos
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        raise fail(path, f"eos_token_id={eos!r} is not an id or a non-empty list of ids")
    bad = [i for i in ids if not 0 <= i < n_tok]
    if bad:
        raise fail(path, f"eos_token_id {bad} out of range for the tokenizer's {n_tok} tokens")
    return tuple(dict.fromkeys(ids)), gen


def write(folder: str, text: TokenizerFiles, source: str) -> None:
    """The tokenizer side into ``folder``: the ``source`` folder's files copied verbatim where
    it has them, the rest written from ``text``'s fields (the source may be gone by now)."""
    for name in FILES:
        src = os.path.join(source, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(folder, name))
    if not os.path.isfile(os.path.join(folder, TOKENIZER)):
        text.tokenizer.save(os.path.join(folder, TOKENIZER))
    if not os.path.isfile(os.path.join(folder, TOKENIZER_CONFIG)):
        write_json(os.path.join(folder, TOKENIZER_CONFIG), {"chat_template": text.chat_template})
    if not os.path.isfile(os.path.join(folder, GENERATION_CONFIG)):
        gen = {"eos_token_id": list(text.stop_ids), "pad_token_id": text.pad_id}
        write_json(os.path.join(folder, GENERATION_CONFIG), gen)
