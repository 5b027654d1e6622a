"""The one boundary every value a user gives passes: declared types, checked where the value enters.

Every value from a YAML file, a `key=value` override, a command-line flag or a `config.json` is checked against a
declared type before anything uses it — type, range (finite, positive, ≥ 2, …), allowed values — and a bad one
stops with the same one-line message everywhere, naming where it came from, the field, the value and what was
expected:

    configs/run.yaml:7: lr = nan: expected a finite number > 0 and ≤ 1e12
    override 'drafter.block_size=1': drafter.block_size = 1: expected an integer from 2 to 1024 (…)
    --max-new-tokens -5: expected an integer from 1 to 2^24 (16,777,216 tokens)
    ckpt/config.json: field 'block_size' = 1: expected an integer from 2 to 1024 (…)

Types are pydantic `Annotated` types (strict: "5" is not an integer, true is not a number, NaN is not finite),
each carrying an `Expect` phrase for the message; `check_fields(cls, values, where)` validates the fields of a
dataclass one by one; `flag(T)` makes the same type an argparse `type=`; `load_yaml` reads a YAML mapping with
line numbers, refusing duplicated keys (PyYAML would keep the last one silently) and reading `2e-3` as a number
(YAML 1.1 would read it as a string).

Every number has a floor that means something and a ceiling the arithmetic downstream holds (counts below 2^31,
token lengths up to 2^24, a temperature 0 or from 1e-4, ports 1–65535); a required string is never empty or blank.
`flag(T)` keeps T's words (`.expect`), which the CLI appends to the flag's help, so each range is stated in --help
by the type that checks it. pydantic is the field's choice for trainer configs (speculators, SpecForge)
and gives declared constraints with machine-readable errors instead of hand-written checks that drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from dflashkit.errors import ConfigError


class Expect:
    """Metadata of an `Annotated` type: what a valid value is, in words ("an integer ≥ 1")."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Expect({self.text!r})"


# ---------------------------------------------------------------------------------------------- the types
# Every number has a floor that means something and a ceiling the arithmetic downstream can hold: a count below
# 2^31 keeps a product of two inside int64 and any product of a few exact in float64; a token length below 2^24
# (16,777,216: above every target's context) keeps a row's attention arithmetic finite; other numbers stay ≤ 1e12.
MAX_COUNT = 2**31 - 1
MAX_TOKENS = 2**24
MAX_NUMBER = 1e12
MIN_TEMPERATURE = 1e-4  # below it logits / T overflows float32 (a logit of 40 / 1e-40 is inf): use 0, greedy

PositiveInt = Annotated[int, Field(ge=1, le=MAX_COUNT), Expect("an integer ≥ 1 and < 2^31")]
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_COUNT), Expect("an integer ≥ 0 and < 2^31")]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1), Expect("an integer from 0 to 2^63 − 1")]
BlockSize = Annotated[
    int, Field(ge=2, le=1024), Expect("an integer from 2 to 1024 (the block: 1 given token + drafts)")
]
TreeBudget = Annotated[int, Field(ge=1, le=4096), Expect("an integer from 1 to 4096 (tree nodes)")]
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS), Expect("an integer from 1 to 2^24 (16,777,216 tokens)")]
NonNegativeTokenCount = Annotated[
    int, Field(ge=0, le=MAX_TOKENS), Expect("an integer from 0 to 2^24 (16,777,216 tokens)")
]
PositiveFloat = Annotated[
    float, Field(gt=0, le=MAX_NUMBER, allow_inf_nan=False), Expect("a finite number > 0 and ≤ 1e12")
]
NonNegativeFloat = Annotated[
    float, Field(ge=0, le=MAX_NUMBER, allow_inf_nan=False), Expect("a finite number ≥ 0 and ≤ 1e12")
]
Fraction = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False), Expect("a number ≥ 0 and < 1")]
UnitInterval = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False), Expect("a number from 0 to 1")]
Probability = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False), Expect("a number > 0 and ≤ 1")]


def _temperature(t: float) -> float:
    if 0 < t < MIN_TEMPERATURE:
        raise ValueError(
            f"expected 0 (greedy) or a number from {MIN_TEMPERATURE:g} to 100: below {MIN_TEMPERATURE:g} the logits / "
            f"T overflow; use 0 for greedy"
        )
    return t


Temperature = Annotated[
    float,
    Field(ge=0, le=100, allow_inf_nan=False),
    AfterValidator(_temperature),
    Expect(f"0 (greedy) or a number from {MIN_TEMPERATURE:g} to 100"),
]
Minutes = Annotated[
    float, Field(gt=0, le=1e6, allow_inf_nan=False), Expect("a number of minutes > 0 and ≤ 1e6 (about 2 years)")
]
Port = Annotated[int, Field(ge=1, le=65535), Expect("a port from 1 to 65535")]
AdamBeta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
AdamBetas = Annotated[
    list[AdamBeta], Field(min_length=2, max_length=2), Expect("a list of two numbers ≥ 0 and < 1, e.g. [0.9, 0.95]")
]
LayerIds = Annotated[
    list[NonNegativeInt], Field(min_length=1), Expect("a non-empty list of decoder-layer indices (integers ≥ 0)")
]
Text = Annotated[str, Field(min_length=1, pattern=r"\S"), Expect("a non-empty string (not only spaces)")]
Bool = Annotated[bool, Expect("true or false")]


def _server_url(url: str) -> str:
    import urllib.parse

    example = "e.g. http://127.0.0.1:8080"
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL of a server, {example}")
    try:
        port = parts.port
    except ValueError:  # urllib: not a number, or outside 0–65535
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raw = parts.netloc.rsplit(":", 1)[-1]
        raise ValueError(f"port {raw}: expected a port from 1 to 65535, {example}")
    return url


ServerUrl = Annotated[
    str, AfterValidator(_server_url), Expect("an http:// or https:// URL with a port from 1 to 65535")
]


CompileSetting = Annotated[Literal["auto", "on", "off"] | bool, Expect("auto, on or off (true / false: on / off)")]


def choice(*values: str) -> Any:
    """A string from a fixed set."""
    return Annotated[Literal[values], Expect("one of " + ", ".join(repr(v) for v in values))]


def optional(t: Any, meaning: str) -> Any:
    """`t` or null; `meaning` says what null means ("null = all captured")."""
    inner = expected_text(t) or "a value"
    return Annotated[t | None, Expect(f"{inner}, or null ({meaning})")]


# ---------------------------------------------------------------------------------------------- messages
def show(value: Any) -> str:
    """A value as a message quotes it: JSON-like, shortened."""
    try:
        text = json.dumps(value, allow_nan=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    text = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}.get(text, text)
    return text if len(text) <= 60 else text[:57] + "..."


def expected_text(t: Any) -> str | None:
    """What a declared type accepts, in the words its error messages use (None when it declares none)."""
    for meta in getattr(t, "__metadata__", ()):
        if isinstance(meta, Expect):
            return meta.text
    return None


_GENERIC = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "missing": "a value (required)",
}


def _phrase(error: dict[str, Any], expect: str | None) -> str:
    """What was expected, for one pydantic error: the field's Expect text, else pydantic's own words."""
    if error["type"] == "value_error":
        return str(error.get("ctx", {}).get("error", error["msg"]))
    if expect:
        return f"expected {expect}"
    if error["type"] in _GENERIC:
        return f"expected {_GENERIC[error['type']]}"
    bound = {"greater_than_equal": ("ge", "≥"), "greater_than": ("gt", ">"), "less_than_equal": ("le", "≤")}
    if error["type"] in bound:
        key, sign = bound[error["type"]]
        return f"expected a number {sign} {error.get('ctx', {}).get(key):g}"
    return "expected " + re.sub(r"^Input should be ", "", error["msg"])


def problem(t: Any, value: Any) -> str | None:
    """Why `value` is not a valid `t` ("expected an integer ≥ 1"), or None when it is."""
    try:
        _adapter(t).validate_python(value, strict=True)
    except ValidationError as e:
        return _phrase(e.errors()[0], expected_text(t))
    return None


@functools.cache
def _adapter(t: Any) -> TypeAdapter:
    return TypeAdapter(t)


# ---------------------------------------------------------------------------------------------- JSON documents
class JsonFields(BaseModel):
    """Base of a declared JSON document (a file dflashkit reads back): the fields a reader uses, strictly typed;
    fields without a default are required, others may hold anything."""

    model_config = ConfigDict(extra="ignore", strict=True)


_PLAIN_SAFETENSORS = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*\.safetensors")


def safetensors_name(where: str, example: str) -> Any:
    """The type of a file name a document gives for a file beside it, in `where` ("the capture directory"): a plain
    `*.safetensors` name — no path separator, no leading dot — so nothing read or rewritten from it leaves that
    directory; a bad one reads "expected a file name in <where> (<example>)"."""

    def check(name: str) -> str:
        if not _PLAIN_SAFETENSORS.fullmatch(name):
            raise ValueError(f"expected a file name in {where} ({example})")
        return name

    return Annotated[str, AfterValidator(check)]


def json_problem(model: Any, doc: Any) -> str | None:
    """Why a parsed JSON document does not fit `model` (a strict pydantic model of the fields a reader uses), as
    'runs.a.chain.n_tokens = "x": expected an integer' — the first wrong field by its path in the document — or
    None when it fits. Fields the model does not declare may hold anything."""
    try:
        model.model_validate(doc, strict=True)
    except ValidationError as e:
        error = max(e.errors(), key=lambda err: len(err["loc"]))  # a union repeats the value per member: go deepest
        if error["type"] == "missing":
            where, _ = _locate(doc, error["loc"][:-1])
            return f"{where + '.' if where else ''}{error['loc'][-1]}: missing (a required field)"
        where, value = _locate(doc, error["loc"])
        return f"{where or 'the document'} = {show(value)}: {_phrase(error, None)}"
    return None


def _locate(doc: Any, loc: tuple[Any, ...]) -> tuple[str, Any]:
    """The dotted path of a pydantic error location as far as it names keys and indices of `doc` (a union's member
    tags are not keys: dropped), and the value found there."""
    where, node = "", doc
    for key in loc:
        if isinstance(node, dict) and key in node:
            where += f".{key}" if where else str(key)
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            where += f"[{key}]"
        else:
            continue
        node = node[key]
    return where, node


# ---------------------------------------------------------------------------------------------- dataclass fields
# metadata of a dataclass field that holds settings nested (`DrafterConfig.head_settings`): the settings dataclasses
# whose fields it stands for at the doors, under their own (flat) names
FLATTENS = "flattens"


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name → declared (Annotated) type of a dataclass, as the doors name its fields: a field holding settings
    nested (metadata `FLATTENS`) stands for their fields, in its place, under their own names (`markov_rank`)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        if FLATTENS in f.metadata:
            for settings in f.metadata[FLATTENS]:
                out.update(field_types(settings))
        else:
            out[f.name] = hints[f.name]
    return out


_Class = typing.TypeVar("_Class", bound=type)


def flat_keywords(nest: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[_Class], _Class]:
    """A class decorator over a dataclass holding settings nested (`FLATTENS`): its constructor takes their fields as
    flat keywords too (`DrafterConfig(kind="dspark", markov_rank=128)`), which `nest(keywords)` (a new dict of its
    fields' keywords) folds into the nested field — the doors give flat keys, the class holds them nested."""

    def wrap(cls: _Class) -> _Class:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, **keywords: Any) -> None:
            init(self, **nest(dict(keywords)))

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return wrap


Where = Callable[[str], str]


def check_fields(cls: type, values: Mapping[str, Any], where: Where, *, prefix: str = "", what: str = "option") -> None:
    """Raise ConfigError for the first value of `values` (field name → value) that its declared type refuses, or
    for a name that is not a field of `cls`. `where(name)` says where the value came from ("run.yaml:7")."""
    types = field_types(cls)
    unknown = sorted(set(values) - set(types))
    if unknown:
        name = unknown[0]
        raise ConfigError(f"{where(name)}: unknown {what} '{prefix}{name}'; valid: {', '.join(sorted(types))}")
    for name, value in values.items():
        why = problem(types[name], value)
        if why:
            raise ConfigError(f"{where(name)}: {prefix}{name} = {show(value)}: {why}")


def fail(where: str, name: str, value: Any, expected: str) -> ConfigError:
    """The one-line error for a value that breaks a rule no single type can say (a mutual constraint):
    `fail("run.yaml:3", "keep_best", True, "eval_every > 0 with it")` → "run.yaml:3: keep_best = true: expected …"."""
    return ConfigError(f"{where}: {name} = {show(value)}: expected {expected}")


# ---------------------------------------------------------------------------------------------- text
def text_problem(value: str, *, from_bytes: bool = False) -> str | None:
    """Why a string is not Unicode text a tokenizer can take, or None. Python strings may hold lone surrogates: an
    unpaired `\\ud800` escape in JSON, or (`from_bytes`: a command-line argument) a byte that was not UTF-8, kept
    as U+DC80–U+DCFF."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(value[e.start])
        if from_bytes and 0xDC80 <= code <= 0xDCFF:
            return f"not valid UTF-8 (byte 0x{code - 0xDC00:02x} at character {e.start + 1})"
        return (
            f"not valid Unicode (a lone surrogate \\u{code:04x} at character {e.start + 1}; \\u escapes of "
            f"surrogates come in pairs)"
        )
    return None


def first_text_problem(value: Any, path: str = "") -> str | None:
    """ "field 'messages[0].content': not valid Unicode (…)" for the first string inside a JSON value (keys
    included) that `text_problem` refuses, or None."""
    if isinstance(value, str):
        why = text_problem(value)
        return f"field '{path or 'value'}': {why}" if why else None
    if isinstance(value, dict):
        for key, item in value.items():
            why = text_problem(key) if isinstance(key, str) else None
            if why:
                return f"a key of '{path or 'the object'}': {why}"
            why = first_text_problem(item, f"{path}.{key}" if path else str(key))
            if why:
                return why
    if isinstance(value, list):
        for i, item in enumerate(value):
            why = first_text_problem(item, f"{path}[{i}]")
            if why:
                return why
    return None


def text_flag(text: str) -> str:
    """argparse `type=` of free text (`--prompt`): refused when empty (or only spaces) or not valid UTF-8 /
    Unicode."""
    import argparse

    if not text.strip():
        raise argparse.ArgumentTypeError(f"{show(text)}: expected {text_flag.expect}")  # type: ignore[attr-defined]
    why = text_problem(text, from_bytes=True)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text


text_flag.expect = "non-empty UTF-8 text"  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- flags
def flag(t: Any, *, name: str = "") -> Callable[[str], Any]:
    """An argparse `type=` that parses a command-line string into `t`'s base type and checks it against `t`:
    `p.add_argument("--max-new-tokens", type=flag(PositiveInt))`."""
    import argparse

    base = _base_type(t)

    def parse(text: str) -> Any:
        try:
            value = _parse_text(text, base)
        except ValueError:
            value = text
        why = problem(t, value)
        if why:
            raise argparse.ArgumentTypeError(f"{show(text) if isinstance(value, str) else show(value)}: {why}")
        return value

    parse.__name__ = name or (expected_text(t) or "value")
    parse.declared = t  # type: ignore[attr-defined]  # what the flag accepts, for its help and the tests
    parse.expect = expected_text(t)  # type: ignore[attr-defined]
    return parse


def key_value_flag(example: str, *, key_optional: bool = False) -> Callable[[str], str]:
    """An argparse `type=` of a `KEY=VALUE` flag (`--drafter num_features=3`): a non-empty key before "=" (the value
    is read later, as YAML), or — `key_optional` — a plain non-empty value (`--drafter CKPT` beside NAME=CKPT)."""
    import argparse

    def parse(text: str) -> str:
        key, eq, _ = text.partition("=")
        plain = key_optional and not eq
        if (plain and not text.strip()) or (not plain and not (eq and key.strip())):
            raise argparse.ArgumentTypeError(f"{show(text)}: expected {parse.expect}")
        return text

    parse.expect = f"{example}" + (" or a plain value" if key_optional else "")  # type: ignore[attr-defined]
    parse.__name__ = "KEY=VALUE"
    return parse


def int_list(
    item: Any = NonNegativeInt, *, what: str = "comma-separated integers", allow_empty: bool = False
) -> Callable[[str], list[int]]:
    """An argparse `type=` for "1,8,14": a list of integers, each checked against `item`."""
    return _number_list(int, item, what, allow_empty, "1,8,14")


def float_list(item: Any, *, what: str = "comma-separated numbers") -> Callable[[str], list[float]]:
    """An argparse `type=` for "0,1": a non-empty list of numbers, each checked against `item`."""
    return _number_list(float, item, what, False, "0,1")


def _number_list(number: type, item: Any, what: str, allow_empty: bool, example: str) -> Callable[[str], list[Any]]:
    import argparse

    def parse(text: str) -> list[Any]:
        parts = [x.strip() for x in text.split(",") if x.strip()]
        try:
            values = [number(x) for x in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{show(text)}: expected {what}, e.g. {example}") from None
        if not values and not allow_empty:
            raise argparse.ArgumentTypeError(f"{show(text)}: expected {what} (at least one)")
        for v in values:
            why = problem(item, v)
            if why:
                raise argparse.ArgumentTypeError(f"{show(text)}: {v} is not valid: {why}")
        return values

    parse.__name__ = what
    parse.item = item  # type: ignore[attr-defined]
    item_text = expected_text(item)
    parse.expect = f"{what}, each {item_text}" if item_text else what  # type: ignore[attr-defined]
    return parse


def parse_assignments(
    items: list[str] | tuple[str, ...], *, example: str = "key=value"
) -> tuple[dict[str, Any], dict[str, str]]:
    """`key=value` strings → ({key: value parsed as YAML}, {key: "override 'key=value'"})."""
    out: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. {example})")
        key, value = item.split("=", 1)
        key = key.strip()
        sources[key] = f"override {item!r}"
        out[key] = parse_yaml_value(value, sources[key])
    return out, sources


def _base_type(t: Any) -> Any:
    args = typing.get_args(t)
    inner = args[0] if getattr(t, "__metadata__", None) else t
    for option in typing.get_args(inner) or (inner,):
        if option in (int, float, bool, str):
            return option
    return str


def _parse_text(text: str, base: Any) -> Any:
    if base is int:
        return int(text.strip())
    if base is float:
        return float(text.strip())
    if base is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ValueError(text)
    return text


# ---------------------------------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `2e-3` / `1e5` as floats (YAML 1.2; YAML 1.1 needs a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml_value(text: str, where: str) -> Any:
    """One YAML scalar / flow value (a `key=value` override's value)."""
    try:
        return _walk(_Loader(text).get_single_node(), (), {}, where) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not a valid YAML value ({' '.join(str(e).split())[:160]})") from None


def load_yaml(path: str | Path) -> tuple[dict[str, Any], dict[tuple[str, ...], int]]:
    """A YAML file holding a mapping → (the mapping, {key path: line number}). Refuses a file that is missing, not
    UTF-8, not YAML, not a mapping, or has a key twice in one mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not valid UTF-8 (byte offset {e.start}); expected a YAML file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    lines: dict[tuple[str, ...], int] = {}
    try:
        node = _Loader(text).get_single_node()
        data = _walk(node, (), lines, str(path)) if node is not None else {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{at}: not valid YAML ({' '.join(str(getattr(e, 'problem', e)).split())})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of options (key: value lines), got {type(data).__name__}")
    return data, lines


def _walk(node: yaml.Node, path: tuple[str, ...], lines: dict[tuple[str, ...], int], source: str) -> Any:
    """Build Python values from a YAML node tree, recording each key's line and refusing duplicated keys."""
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        first: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = _Loader("").construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)) or key is None:
                raise ConfigError(f"{source}:{line}: a key must be a plain name, got {show(key)}")
            if key in first:
                raise ConfigError(
                    f"{source}:{line}: key '{'.'.join([*path, str(key)])}' is given twice (first at line "
                    f"{first[key]}); YAML would silently keep the last one"
                )
            first[key] = line
            lines[(*path, str(key))] = line
            out[key] = _walk(value_node, (*path, str(key)), lines, source)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(child, (*path, str(i)), lines, source) for i, child in enumerate(node.value)]
    return _Loader("").construct_object(node, deep=True)


def memory_available() -> int:
    """Bytes this process could allocate: free RAM, or the largest GPU's memory when CUDA is there."""
    import psutil

    best = psutil.virtual_memory().available
    import torch

    if torch.cuda.is_available():
        best = max(best, *(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())))
    return int(best)


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


__all__ = [
    "FLATTENS",
    "MAX_COUNT",
    "MAX_NUMBER",
    "MAX_TOKENS",
    "MIN_TEMPERATURE",
    "AdamBetas",
    "BlockSize",
    "Bool",
    "Expect",
    "Fraction",
    "JsonFields",
    "LayerIds",
    "Minutes",
    "NonNegativeFloat",
    "NonNegativeInt",
    "NonNegativeTokenCount",
    "Port",
    "PositiveFloat",
    "PositiveInt",
    "Probability",
    "Seed",
    "ServerUrl",
    "Temperature",
    "Text",
    "TokenCount",
    "TreeBudget",
    "UnitInterval",
    "check_fields",
    "choice",
    "fail",
    "field_types",
    "finite",
    "flag",
    "flat_keywords",
    "int_list",
    "json_problem",
    "key_value_flag",
    "load_yaml",
    "memory_available",
    "optional",
    "parse_assignments",
    "parse_yaml_value",
    "problem",
    "safetensors_name",
    "show",
]
