"""Tokenizers built offline from what a checkpoint carries: the GGUF vocab and merges (byte-level BPE, or
Gemma's SentencePiece vocabulary), or a Hugging Face `tokenizer.json`.
Chat templates (Jinja, as shipped with the checkpoint: tokenizer_config.json,
chat_template.jinja or GGUF metadata) are rendered in a sandbox set up as transformers sets up its own
(loop controls, raise_exception, strftime_now, a non-escaping tojson, every special token by name), so
a template renders the same string here as with `apply_chat_template` there."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from errors import UserError

# llama.cpp's names for the pre-tokenizer of GPT-2-style byte-level BPE vocabularies. "smollm" splits
# every digit on its own before the GPT-2 regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM).
_DIGIT_SPLITTING_PRE = {"smollm"}
_GPT2_REGEX_PRE = {"gpt2", "default", "smollm", "refact", "starcoder", "codeshell", "jais"}
# Pre-tokenizers that split with their own regex before the byte-level mapping (llama.cpp's names; the
# patterns are those of the models' tokenizer.json files). Llama 3 groups digits by three and Qwen2
# splits them one by one; both match English contractions case-insensitively.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_REGEX_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_GGUF_TOKEN_TYPE_CONTROL = 3
_GGUF_TOKEN_TYPE_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's visible space
# SentencePiece ("llama") vocabularies this module reads, by architecture.
GGUF_SENTENCEPIECE_ARCHITECTURES = ("gemma3",)


class Tokenizer:
    """Text <-> ids, special tokens, and the checkpoint's chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        bos_id: int | None,
        eos_ids: list[int],
        chat_template: str | None,
        add_bos: bool,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.chat_template = chat_template
        self.add_bos = add_bos
        # Template variables: bos_token, eos_token, unk_token, pad_token, ... (strings), as transformers
        # passes them; bos/eos default to the tokens of bos_id / eos_ids[0].
        self.special_tokens = dict(special_tokens or {})
        if self.bos_id is not None:
            self.special_tokens.setdefault("bos_token", self.id_to_token(self.bos_id) or "")
        if self.eos_ids:
            self.special_tokens.setdefault("eos_token", self.id_to_token(self.eos_ids[0]) or "")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. from a chat template) map to their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def special_token_ids(self) -> list[int]:
        return sorted(t for t in self.backend.get_added_tokens_decoder() if t is not None)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **variables: object) -> str:
        """The chat template applied to `messages`, exactly as transformers' apply_chat_template(...,
        tokenize=False) renders it (extra `variables`, e.g. enable_thinking, reach the template too)."""
        if not self.chat_template:
            raise UserError("this checkpoint has no chat template; pass --no-chat")
        try:
            template = _compile_chat_template(self.chat_template)
            context = {"tools": None, "documents": None, **self.special_tokens, **variables}
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise UserError(f"the checkpoint's chat template failed: {e}") from None

    def apply_chat_template(self, user_message: str) -> str:
        """One user turn and the assistant's generation prompt, ready for encode()."""
        text = self.render_chat([{"role": "user", "content": user_message}])
        bos = self.special_tokens.get("bos_token", "")
        # A template that writes the BOS token itself must not get a second one from encode().
        if self.add_bos and bos and text.startswith(bos):
            text = text[len(bos) :]
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, separators: tuple | None = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON (as transformers does).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(source)


def byte_level_bpe(
    vocab: dict[str, int], merges: list[tuple[str, str]], split_digits: bool, split_regex: str | None = None
) -> HFTokenizer:
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_regex is None)
    if split_regex is not None:
        split = pre_tokenizers.Split(Regex(split_regex), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif split_digits:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first: every split of a token into two
    tokens, ranked by the token's position in the vocabulary (SentencePiece BPE assigns ids in merge
    order; Gemma's scores are that order too, -id, except for special and byte tokens), then by the
    longer left piece. These are the merges transformers derives from the same GGUF (its
    `generate_merges`), so both tokenizers split text alike."""
    vocab = set(tokens)
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def sentencepiece_bpe(tokens: list[str], token_types: list[int]) -> HFTokenizer:
    """Gemma's SentencePiece BPE: spaces as U+2581 with no dummy prefix, byte fallback (<0xNN> tokens)
    for what the vocabulary lacks, control tokens matched whole as special tokens and user-defined ones
    (newline runs, HTML tags) matched whole as ordinary tokens, as llama.cpp and transformers do."""
    # A run of spaces is stored as real spaces; the text it matches has been normalised to U+2581.
    spaces = {_SPACE * len(t) for t in tokens if t and not t.strip(" ")}
    tokens = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=sentencepiece_merges(tokens),
                                     unk_token="<unk>" if "<unk>" in tokens else None, fuse_unk=True,
                                     byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    types = token_types or [0] * len(tokens)  # check_tokenizer_keys: one type per token, or none
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types, strict=True) if kind == _GGUF_TOKEN_TYPE_CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types, strict=True)
                        if kind == _GGUF_TOKEN_TYPE_USER_DEFINED and t not in spaces])
    return backend


def _gguf_backend(meta: dict) -> HFTokenizer:
    kind, arch = meta.get("tokenizer.ggml.model"), meta.get("general.architecture")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type", [])
    if kind == "llama" and arch in GGUF_SENTENCEPIECE_ARCHITECTURES:
        if meta.get("tokenizer.ggml.add_space_prefix", False):
            raise UserError("GGUF SentencePiece tokenizers with add_space_prefix are not supported")
        return sentencepiece_bpe(tokens, token_types)
    if kind != "gpt2":
        raise UserError(f"unsupported GGUF tokenizer model {kind!r} for architecture {arch!r} (supported: gpt2-style "
                        f"byte-level BPE; SentencePiece for {', '.join(GGUF_SENTENCEPIECE_ARCHITECTURES)})")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _GPT2_REGEX_PRE | set(_SPLIT_REGEX_PRE):
        names = ", ".join(sorted(_GPT2_REGEX_PRE | set(_SPLIT_REGEX_PRE)))
        raise UserError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {names})")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]  # none: a byte vocabulary
    backend = byte_level_bpe({t: i for i, t in enumerate(tokens)}, merges, split_digits=pre in _DIGIT_SPLITTING_PRE,
                             split_regex=_SPLIT_REGEX_PRE.get(pre))
    special = [
        tokens[i]
        for i, t in enumerate(token_types)
        if t in (_GGUF_TOKEN_TYPE_CONTROL, _GGUF_TOKEN_TYPE_USER_DEFINED)
    ]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return backend


def tokenizer_from_gguf_metadata(meta: dict) -> Tokenizer:
    backend = _gguf_backend(meta)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(
        backend,
        bos_id=int(bos) if bos is not None else None,
        eos_ids=eos_ids,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint's side file, or one clear error naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object")
    return value


def tokenizer_from_hf_dir(directory: Path, config: dict) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{directory} has no tokenizer.json")
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library's own error type: not JSON, or not a tokenizer
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = read_json(tok_config_path) if tok_config_path.is_file() else {}

    def token_id(entry: object) -> int | None:
        if isinstance(entry, dict):
            entry = entry.get("content")
        return backend.token_to_id(entry) if isinstance(entry, str) else None

    eos = config.get("eos_token_id")
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        eos = read_json(gen_path).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids and token_id(tok_config.get("eos_token")) is not None:
        eos_ids = [token_id(tok_config["eos_token"])]
    bos = config.get("bos_token_id")
    if bos is None:
        bos = token_id(tok_config.get("bos_token"))
    # Llama-style tokenizer.json files add BOS themselves through their post-processor.
    adds_bos = bos is not None and bos in backend.encode("a", add_special_tokens=True).ids
    if adds_bos:
        backend.post_processor = None
    # As in transformers: a chat_template.jinja file takes priority over the tokenizer_config.json entry.
    template_file = directory / "chat_template.jinja"
    chat_template = template_file.read_text() if template_file.is_file() else tok_config.get("chat_template")
    if isinstance(chat_template, list):  # list of named templates: take the default one
        chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
    special = {}
    map_path = directory / "special_tokens_map.json"  # older checkpoints keep the special tokens here
    entries = {**(read_json(map_path) if map_path.is_file() else {}), **tok_config}
    for key, entry in entries.items():
        if key.endswith("_token") and key != "additional_special_tokens":
            text = entry.get("content") if isinstance(entry, dict) else entry
            if isinstance(text, str):
                special[key] = text
    return Tokenizer(backend, bos_id=bos, eos_ids=eos_ids, chat_template=chat_template, add_bos=adds_bos,
                     special_tokens=special)
