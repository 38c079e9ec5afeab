"""Load policy files: YAML -> file-format models -> compiled Policy, or every problem at once.

Each problem names the file, the 1-based line, the dotted field, what is wrong and how to fix
it. Lines come from the composed YAML node tree; a field that is absent falls back to its
nearest parent that exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from sandgate.errors import BadRequest, SandgateError
from sandgate.gateway import route
from sandgate.policy.ask import compile_webhook
from sandgate.policy.compiler import (
    NAME_RE,
    SecretUse,
    check_identity_name,
    check_rules,
    compile_rules,
    compile_secret,
    compile_test,
    missing_hosts,
)
from sandgate.policy.gateways import check_overlaps, compile_gateway
from sandgate.policy.llm import compile_budget, compile_price
from sandgate.policy.model import (
    Budget,
    Gateway,
    Identity,
    Policy,
    PolicyTest,
    Price,
    Rule,
    SecretRef,
    Source,
    Webhook,
)
from sandgate.policy.ratelimits import compile_limits
from sandgate.policy.schema import (
    BudgetDefSpec,
    GatewaySpec,
    IdentitySpec,
    Loc,
    PolicyFile,
    PriceSpec,
    RuleSpec,
    SecretSpec,
    TestSpec,
    WebhookSpec,
)
from sandgate.secrets.aws_scope import hosts_may_give, resolve

SCHEMA_FIX = "see `sandgate schema` for the file format"


@dataclass(frozen=True, slots=True)
class PolicyProblem:
    file: str
    line: int
    field: str
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}: "
        fld = f"{self.field}: " if self.field else ""
        return f"{where}{fld}{self.message.rstrip('.')}. Fix: {self.fix}"


class PolicyError(SandgateError, ValueError):
    """Policy files could not be loaded: every problem, each located and with a fix."""

    def __init__(self, problems: Sequence[PolicyProblem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def __str__(self) -> str:
        return "\n".join(str(p) for p in self.problems)


def policy_json_schema() -> dict[str, Any]:
    """JSON Schema of the v1 file format."""
    schema = PolicyFile.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Sandgate policy file (v1)"
    return schema


POLICY_SUFFIXES = (".yaml", ".yml")


def discover_policy_files(path: str | Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """The files a policy directory is made of, and every other entry with why it is skipped.

    Read: regular files at the top level named *.yaml or *.yml (any case), sorted by name.
    Skipped: hidden files, subfolders (not searched), anything else (e.g. `x.yaml.new`,
    `x.yml~`). A missing directory gives two empty lists.
    """
    d = Path(path)
    read: list[Path] = []
    skipped: list[tuple[str, str]] = []
    if not d.is_dir():
        return read, skipped
    for p in sorted(d.iterdir(), key=lambda p: p.name):
        if p.name.startswith("."):
            if p.name not in (".", ".."):
                skipped.append((str(p), "hidden file"))
        elif p.is_dir():
            skipped.append((str(p), "subfolder: only files directly in the policy directory "
                            "are read"))
        elif p.suffix.lower() not in POLICY_SUFFIXES:
            skipped.append((str(p), "not named *.yaml or *.yml"))
        elif not p.is_file():
            skipped.append((str(p), "not a regular file"))
        else:
            read.append(p)
    return read, skipped


def load_policy_dir(path: str | Path) -> Policy:
    """Load every *.yaml and *.yml file (any case) of a directory (sorted) as one policy."""
    d = Path(path)
    if not d.is_dir():
        raise PolicyError([PolicyProblem(str(d), 0, "", "policy directory does not exist"
                                         if not d.exists() else "not a directory",
                                         "point at a directory of *.yaml policy files")])
    files, _skipped = discover_policy_files(d)
    if not files:
        raise PolicyError([PolicyProblem(str(d), 0, "", "the policy directory has no *.yaml or "
                                         "*.yml files", "add at least one policy file "
                                         "(see policies/sandgate.yaml)")])
    return load_policy_files(files)


def load_policy_files(paths: Sequence[Path]) -> Policy:
    if not paths:
        raise PolicyError([PolicyProblem("-", 0, "", "no policy files given",
                                         "give at least one policy file")])
    problems: list[PolicyProblem] = []
    parts: list[_FilePart] = []
    roots: list[PolicyProblem] = []  # the problems of files that could not be read at all
    for p in paths:
        mine: list[PolicyProblem] = []
        part = _load_file(Path(p), mine)
        problems += mine
        if part is None:
            roots += mine
        else:
            parts.append(part)
    if roots:
        # One root error per broken file, and nothing else: the other files refer to secrets,
        # templates, gateways and identities the broken one may define, and would each report
        # them missing (a cascade that buries the one line to fix).
        raise PolicyError([dataclasses.replace(
            pr, fix=f"{pr.fix} (the other files are checked once this one loads)")
            for pr in roots] if len(paths) > 1 else roots)
    policy = _merge(parts, problems)
    if problems:
        order = {str(Path(p)): i for i, p in enumerate(paths)}
        problems.sort(key=lambda pr: (order.get(pr.file, len(order)), pr.line))
        raise PolicyError(problems)
    return policy


# --- one file -----------------------------------------------------------------------------


@dataclass
class _IdentityPart:
    """What one file says about an identity (an identity may span files)."""

    src: Source
    spec: IdentitySpec | None  # None: its settings are broken (reported)
    rules: list[tuple[int, Rule]]  # (index in this file's `rules:`, compiled rule)


@dataclass
class _FilePart:
    file: str
    root: yaml.Node
    secrets: dict[str, SecretRef]
    identities: dict[str, _IdentityPart]
    tests: list[tuple[PolicyTest, Loc]]
    secret_sources: dict[str, Source] = field(default_factory=dict)  # including broken ones
    template_sources: dict[str, Source] = field(default_factory=dict)
    templates: dict[str, list[Rule]] = field(default_factory=dict)  # identity "" until used
    uses: list[SecretUse] = field(default_factory=list)
    gateways: list[tuple[Gateway, Loc]] = field(default_factory=list)
    webhooks: dict[str, tuple[Webhook, Loc]] = field(default_factory=dict)
    budgets: dict[str, tuple[Budget, Loc]] = field(default_factory=dict)
    prices: list[Price] = field(default_factory=list)

    def line(self, loc: Loc) -> int:
        return line_of(self.root, loc)

    def problem(self, loc: Loc, message: str, fix: str) -> PolicyProblem:
        return PolicyProblem(self.file, self.line(loc), field_path(loc), message, fix)


_ROOT_FIX = ("check indentation and quoting near this line; quote values that start with '*', "
             "'{', '[', '&', '!' or '%', e.g. hosts: ['*.example.com'] and "
             "x-api-key: \"{{ secrets.NAME }}\"")
# PyYAML's words for a `: ` inside a plain (unquoted) value, in a block and in a flow mapping
_COLON_PROBLEMS = ("mapping values are not allowed here", "expected ',' or '}', but got ':'")


def _plain_colon(text: str, e: yaml.MarkedYAMLError) -> tuple[str, str, str] | None:
    """(the key, the message, the fix) when the error is a `: ` inside a plain value (`reason:
    see: the wiki`): YAML reads it as a second key, and the usual quoting hint (values that
    start with '*', '{', ...) does not say so. None for any other error."""
    mark = e.problem_mark
    if mark is None or e.problem not in _COLON_PROBLEMS:
        return None
    lines = text.splitlines()
    if mark.line >= len(lines):
        return None
    line, col = lines[mark.line], mark.column
    if col >= len(line) or line[col] != ":":
        return None
    sep = line.rfind(": ", 0, col)  # the key's own `: `, before the one in the value
    if sep < 0:
        return None
    start = max(line.rfind(c, 0, sep) for c in ("{", ",", "-", " ")) + 1
    key = line[start:sep].strip()
    flow = e.problem.startswith("expected")
    rest = line[sep + 2:]
    if flow:
        ends = [i for i in (rest.find(","), rest.find("}")) if i >= 0]
        value = rest[:min(ends)] if ends else rest
    else:
        value = rest.split(" #", 1)[0]
    value = value.strip()
    if not key or not value:
        return None
    quoted = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return (key, f"the value of `{key}` contains ': ' (a colon and a space), which YAML reads "
            "as the start of another key inside an unquoted value",
            f"quote the value: {key}: {quoted}")


def _load_file(path: Path, problems: list[PolicyProblem]) -> _FilePart | None:
    file = str(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        problems.append(PolicyProblem(file, 0, "", f"cannot read file: {e.strerror}",
                                      "check the path and permissions"))
        return None
    except UnicodeDecodeError:
        problems.append(PolicyProblem(file, 1, "", "the file is not UTF-8 text",
                                      "save it as UTF-8"))
        return None
    try:
        loader = yaml.SafeLoader(text)  # checks every character first
    except yaml.reader.ReaderError as e:
        problems.append(PolicyProblem(
            file, text.count("\n", 0, e.position) + 1, "",
            f"the file contains character {e.character:#x}, which YAML does not allow",
            "remove control characters; use plain UTF-8 text"))
        return None
    try:
        root = loader.get_single_node()
        dupes = _duplicate_keys(root) if root is not None else []
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        what = " ".join(x for x in (e.context, e.problem) if x)
        colon = _plain_colon(text, e)
        problems.append(PolicyProblem(
            file, line, "", f"YAML syntax error: {what}", _ROOT_FIX) if colon is None else
            PolicyProblem(file, line, "", f"YAML syntax error: {colon[1]}", colon[2]))
        return None
    except yaml.YAMLError as e:
        problems.append(PolicyProblem(file, 1, "", f"YAML error: {e}", "fix the YAML syntax"))
        return None
    except RecursionError:
        problems.append(PolicyProblem(file, 1, "", "the YAML is nested too deeply",
                                      "a policy needs only a few levels of nesting"))
        return None
    finally:
        loader.dispose()

    if root is None:
        problems.append(PolicyProblem(file, 1, "", "the file is empty",
                                      "start it with `version: v1`, or delete it"))
        return None
    if not isinstance(data, dict):
        problems.append(PolicyProblem(
            file, root.start_mark.line + 1, "", f"the file is a YAML {type(data).__name__}, "
            "not a mapping", "write a mapping with `version: v1` and `secrets`, `identities`, "
            "`tests` keys"))
        return None
    part = _FilePart(file, root, {}, {}, [])
    for dloc, first in dupes:
        problems.append(part.problem(dloc, f"key {dloc[-1]!r} appears twice in this mapping "
                                     f"(first at line {first})",
                                     "keep one; YAML would silently use the last"))

    report = _reporter(part, problems)
    if "version" not in data:
        problems.append(PolicyProblem(file, 1, "version", "missing `version`",
                                      "add `version: v1` as the first line"))
    elif data["version"] != "v1":
        problems.append(part.problem(("version",), f"unknown version {data['version']!r}",
                                     "this Sandgate reads `version: v1`"))
        return None
    allowed = list(PolicyFile.model_fields)
    for key in data:
        if key not in allowed:
            report((key,), f"unknown key {key!r}", _unknown_key_fix(str(key), allowed))

    secrets = _section(data, "secrets", dict, report)
    for name, raw in secrets.items():
        part.secret_sources[str(name)] = Source(file, part.line(("secrets", name)))
        spec = _validate(SecretSpec, raw, ("secrets", name), report)
        if spec is None:
            continue
        ref = compile_secret(str(name), spec, Source(file, part.line(("secrets", name))), report)
        if ref is not None:
            part.secrets[str(name)] = ref

    templates = _section(data, "templates", dict, report)
    for tname, traw in templates.items():
        tbase: Loc = ("templates", tname)
        part.template_sources[str(tname)] = Source(file, part.line(tbase))
        if not NAME_RE.fullmatch(str(tname)):
            report(tbase, f"template name {tname!r} is not a valid name",
                   "use letters, digits, '.', '_' and '-', starting with a letter or digit")
        if not isinstance(traw, list):
            report(tbase, f"template {tname!r} must be a list of rules, not a "
                   f"{_yaml_type(traw)}", "write a YAML list of rules, each starting with "
                   "`- name: ...` (a template is a list of rules)")
            continue
        t_at = _under(tbase)
        tspecs = _rule_specs(traw, t_at, report)
        trules = compile_rules("", tspecs, file, part.line, report, part.uses, t_at)
        part.templates[str(tname)] = [r for _, r in trules]

    identities = _section(data, "identities", dict, report)
    for name, raw in identities.items():
        loc: Loc = ("identities", name)
        src = Source(file, part.line(loc))
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            part.identities[str(name)] = _IdentityPart(src, None, [])
            report(loc, f"identity {name!r} must be a mapping, not a {_yaml_type(raw)}",
                   "write `rules:` (and optionally `description:`) under it")
            continue
        check_identity_name(str(name), report)
        # Validate each rule on its own so one broken rule does not hide the others' problems.
        raw_rules = raw.get("rules")
        top = {k: v for k, v in raw.items() if k != "rules"}
        ispec = _validate(IdentitySpec, top, loc, report)
        if ispec is not None and ispec.limits is not None and compile_limits(
                ispec.limits, (*loc, "limits"), report) is None:
            ispec = None  # reported; the identity does not load
        specs: list[tuple[int, RuleSpec]] = []
        if raw_rules is not None and not isinstance(raw_rules, list):
            report((*loc, "rules"), f"`rules` must be a list, not a {_yaml_type(raw_rules)}",
                   "write a YAML list of rules, each starting with `- name: ...`")
        else:
            specs = _rule_specs(raw_rules or [], _under((*loc, "rules")), report)
        rules = compile_rules(str(name), specs, file, part.line, report, part.uses,
                              _under((*loc, "rules")))
        part.identities[str(name)] = _IdentityPart(src, ispec, rules)

    tests = _section(data, "tests", list, report)
    for i, raw in enumerate(tests):
        tloc: Loc = ("tests", i)
        tspec = _validate(TestSpec, raw, tloc, report)
        if tspec is None:
            continue
        t = compile_test(tspec, tloc, Source(file, part.line(tloc)), report, part.uses)
        if t is not None:
            part.tests.append((t, tloc))

    gateways = _section(data, "gateways", list, report)
    for i, raw in enumerate(gateways):
        gloc: Loc = ("gateways", i)
        gspec = _validate(GatewaySpec, raw, gloc, report)
        if gspec is None:
            continue
        gw = compile_gateway(gspec, gloc, Source(file, part.line(gloc)), report)
        if gw is not None:
            part.gateways.append((gw, gloc))
    load_webhooks(part, _section(data, "webhooks", dict, report), report)
    for bname, braw in _section(data, "budgets", dict, report).items():
        bloc: Loc = ("budgets", bname)
        bspec = _validate(BudgetDefSpec, braw, bloc, report)
        if bspec is not None:
            budget = compile_budget(str(bname), bspec, bloc, Source(file, part.line(bloc)),
                                    report)
            if budget is not None:
                part.budgets[budget.name] = (budget, bloc)
    for i, praw in enumerate(_section(data, "prices", list, report)):
        ploc: Loc = ("prices", i)
        pspec = _validate(PriceSpec, praw, ploc, report)
        price = compile_price(pspec, ploc, report) if pspec is not None else None
        if price is not None:
            part.prices.append(price)
    return part


def load_webhooks(part: _FilePart, raw: dict[str, Any], report: Callable[..., None]) -> None:
    """A file's `webhooks:` (sandgate.policy.ask); the HMAC key's secret is a secret use."""
    for name, wraw in raw.items():
        wloc: Loc = ("webhooks", name)
        wspec = _validate(WebhookSpec, wraw, wloc, report)
        if wspec is None:
            continue
        hook = compile_webhook(str(name), wspec, wloc, Source(part.file, part.line(wloc)),
                               report)
        if hook is not None:
            part.webhooks[hook.name] = (hook, wloc)
            if hook.secret is not None:
                part.uses.append(SecretUse(hook.secret, (*wloc, "secret")))


def _reporter(part: _FilePart, problems: list[PolicyProblem]) -> Callable[[Loc, str, str], None]:
    def report(loc: Loc, message: str, fix: str) -> None:
        problems.append(part.problem(loc, message, fix))

    return report


def _under(base: Loc) -> Callable[[int], Loc]:
    """The location of the i-th entry of the list at `base`."""
    def at(i: int) -> Loc:
        return (*base, i)

    return at


def _rule_specs(raw_rules: list[Any], loc_of: Callable[[int], Loc],
                report: Callable[[Loc, str, str], None]) -> list[tuple[int, RuleSpec]]:
    """Each rule validated on its own. A rule with shape errors is still checked for meaning
    (without the broken keys); the policy fails to load either way."""
    out: list[tuple[int, RuleSpec]] = []
    for i, rraw in enumerate(raw_rules):
        missing_hosts(rraw, loc_of(i), report)
        rs, _ok = _validate_lenient(RuleSpec, rraw, loc_of(i), report)
        if rs is not None:
            out.append((i, rs))
    return out


def _section(data: dict[str, Any], key: str, kind: type, report: Callable[..., None]) -> Any:
    val = data.get(key)
    if val is None:
        return kind()
    if not isinstance(val, kind):
        what = "a mapping of name -> entry" if kind is dict else "a list"
        report((key,), f"`{key}` must be {what}, not a {_yaml_type(val)}", SCHEMA_FIX)
        return kind()
    return val


def _validate(model: type[BaseModel], raw: Any, base: Loc,
              report: Callable[[Loc, str, str], None]) -> Any:
    """Validate, reporting every error. Returns the model, or None when it is invalid."""
    spec, ok = _validate_lenient(model, raw, base, report)
    return spec if ok else None


def _validate_lenient(model: type[BaseModel], raw: Any, base: Loc,
                      report: Callable[[Loc, str, str], None]) -> tuple[Any, bool]:
    """Validate, reporting every error; (model, True) when valid.

    When invalid, retry without the offending optional keys so that the rest can still be
    checked for meaning: (model built from the rest, False), or (None, False).
    """
    try:
        return model.model_validate(raw), True
    except ValidationError as e:
        bad: set[str] = set()
        for err in e.errors():
            rel: Loc = tuple(x for x in err["loc"] if x != "[key]")
            msg, fix = _explain(model, err, rel)
            report((*base, *rel), msg, fix)
            if rel and isinstance(rel[0], str):
                bad.add(rel[0])
    if not isinstance(raw, dict):
        return None, False
    required = {n for n, f in model.model_fields.items() if f.is_required()}
    if bad & required:
        return None, False
    try:
        return model.model_validate({k: v for k, v in raw.items() if k not in bad}), False
    except ValidationError:
        return None, False


def _explain(model: type[BaseModel], err: Any, rel: Loc) -> tuple[str, str]:
    t = err["type"]
    inp = err.get("input")
    last = rel[-1] if rel else ""
    if t == "extra_forbidden":
        allowed = _allowed_keys(model, rel[:-1])
        return f"unknown key {last!r}", _unknown_key_fix(str(last), allowed)
    if t == "missing":
        return f"required key `{last}` is missing", f"add `{last}`"
    if t == "too_short":
        return f"`{last}` must not be empty", f"list at least one value, or remove `{last}`"
    if t == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        return f"{inp!r} is not allowed here", f"use one of {expected}"
    if t == "string_type":
        fix = "write it as a string"
        if isinstance(inp, dict) and "inject" in rel:
            fix = ("quote templates in YAML: x-api-key: \"{{ secrets.NAME }}\" (unquoted "
                   "braces are a YAML mapping)")
        elif isinstance(inp, (int, float, bool)):
            fix = "quote it"
        return f"expected a string, got a {_yaml_type(inp)}", fix
    if t in ("int_type", "int_parsing"):
        return f"expected an integer, got a {_yaml_type(inp)}", "write a plain number, unquoted"
    if t in ("bool_type", "bool_parsing"):
        return f"expected true or false, got a {_yaml_type(inp)}", "write true or false"
    if t in ("list_type",):
        return f"expected a list, got a {_yaml_type(inp)}", "write a YAML list, e.g. [a, b]"
    if t in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got a {_yaml_type(inp)}", SCHEMA_FIX
    return str(err.get("msg", "invalid value")), SCHEMA_FIX


def _yaml_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "list"
    if isinstance(v, dict):
        return "mapping"
    return type(v).__name__


def _unknown_key_fix(key: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    return f"{hint}remove it; keys allowed here: {', '.join(allowed)}"


def _allowed_keys(model: type[BaseModel], rel: Loc) -> list[str]:
    """The keys of the model found at `rel` inside `model` (walking field annotations)."""
    ann: Any = model
    for step in rel:
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            f = ann.model_fields.get(str(step))
            if f is None:
                return []
            ann = f.annotation
            continue
        origin = typing.get_origin(ann)
        args = typing.get_args(ann)
        if origin is list and args:
            ann = args[0]
        elif origin is dict and len(args) == 2:
            ann = args[1]
        else:
            return []
    ann = _unwrap(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return list(ann.model_fields)
    return []


def _unwrap(ann: Any) -> Any:
    origin = typing.get_origin(ann)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


# --- YAML node locations --------------------------------------------------------------------


def line_of(root: yaml.Node, loc: Loc) -> int:
    """1-based line of the node at `loc`, or of its nearest existing parent.

    For a mapping entry this is the line of its key.
    """
    node: yaml.Node = root
    line = root.start_mark.line + 1
    for step in loc:
        if isinstance(node, yaml.MappingNode):
            found: tuple[yaml.Node, yaml.Node] | None = None
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(step):
                    found = (k, v)
            if found is None:
                break
            line = found[0].start_mark.line + 1
            node = found[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int):
            if not 0 <= step < len(node.value):
                break
            node = node.value[step]
            line = node.start_mark.line + 1
        else:
            break
    return line


def field_path(loc: Loc) -> str:
    out = ""
    for step in loc:
        if isinstance(step, int):
            out += f"[{step}]"
        else:
            out += ("." if out else "") + str(step)
    return out


def _duplicate_keys(root: yaml.Node) -> list[tuple[Loc, int]]:
    """Keys given twice in one mapping: YAML keeps the last silently; a policy must not."""
    out: list[tuple[Loc, int]] = []
    seen_nodes: set[int] = set()

    def walk(node: yaml.Node, loc: Loc) -> None:
        if id(node) in seen_nodes:
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode):
                    if k.value in first and k.value != "<<":
                        out.append(((*loc, k.value), first[k.value]))
                    first.setdefault(k.value, k.start_mark.line + 1)
                    walk(v, (*loc, k.value))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                walk(v, (*loc, i))

    walk(root, ())
    return out


# --- merging files ----------------------------------------------------------------------------


T = typing.TypeVar("T")


def _defined_once(
    kind: str, parts: list[_FilePart],
    of: Callable[[_FilePart], tuple[Mapping[str, Source], Mapping[str, T]]],
    problems: list[PolicyProblem],
) -> tuple[dict[str, T], dict[str, Source]]:
    """Merge the `kind`s (secrets, templates) of all files: each name defined in one place only.

    Returns (name -> compiled value, name -> where it is first defined, broken ones included).
    """
    values: dict[str, T] = {}
    first: dict[str, Source] = {}
    for part in parts:
        sources, compiled = of(part)
        for name, src in sources.items():
            prev = first.get(name)
            if prev is not None:
                problems.append(part.problem(
                    (f"{kind}s", name), f"{kind} {name!r} is also defined in {prev}",
                    f"define each {kind} once; rename or remove one of {prev} and {src}"))
                continue
            first[name] = src
            if name in compiled:
                values[name] = compiled[name]
    return values, first


def _merge(parts: list[_FilePart], problems: list[PolicyProblem]) -> Policy:
    identities: dict[str, Identity] = {}
    secrets, secret_first = _defined_once(
        "secret", parts, lambda part: (part.secret_sources, part.secrets), problems)
    templates, template_first = _defined_once(
        "template", parts, lambda part: (part.template_sources, part.templates), problems)
    identity_first: dict[str, Source] = {}
    for part in parts:
        for name, ipart in part.identities.items():
            identity_first.setdefault(name, ipart.src)
    for name in identity_first:
        ident = _merge_identity(name, parts, templates, template_first, problems)
        if ident is not None:
            identities[name] = ident

    by_placeholder: dict[str, SecretRef] = {}
    for ref in secrets.values():
        other = by_placeholder.get(ref.placeholder)
        if other is not None:
            problems.append(_at_secret(parts, ref, "placeholder",
                                       f"placeholder {ref.placeholder!r} is also used by secret "
                                       f"{other.name!r} ({other.source})",
                                       "give each secret its own placeholder"))
            continue
        by_placeholder[ref.placeholder] = ref

    for part in parts:
        _check_uses(part, part.uses, secret_first, problems, secrets)
        for name, ipart in part.identities.items():
            wider = ipart.spec.narrower_than if ipart.spec is not None else None
            if wider is not None and wider not in identity_first:
                problems.append(part.problem(
                    ("identities", name, "narrower_than"),
                    f"narrower_than names unknown identity {wider!r}",
                    f"use one of: {', '.join(sorted(identity_first))}"))

    tests: list[PolicyTest] = []
    for part in parts:
        for t, tloc in part.tests:
            tident = identities.get(t.identity)
            if t.identity in identity_first and tident is None:
                continue  # the identity itself is broken and reported
            if tident is None:
                problems.append(part.problem(
                    (*tloc, "identity"), f"test names unknown identity {t.identity!r}",
                    f"use one of: {', '.join(sorted(identities)) or '(none defined)'}"))
                continue
            if t.rule is not None and t.rule not in {r.name for r in tident.rules}:
                problems.append(part.problem(
                    (*tloc, "rule"), f"identity {t.identity!r} has no rule {t.rule!r}",
                    f"use one of: {', '.join(r.name for r in tident.rules) or '(no rules)'}"))
                continue
            tests.append(t)

    gateways = [(gw, _gateway_problem(part, gloc, problems))
                for part in parts for gw, gloc in part.gateways]
    check_overlaps(gateways)
    served = [gw for gw, _ in gateways]
    for part in parts:
        for t, tloc in part.tests:
            if not t.gateway:
                continue
            try:  # the gateway listener's own mapping
                route(served, t.method, t.url)
            except BadRequest as e:
                problems.append(part.problem((*tloc, "request"), e.reason, e.hint or (
                    "start the path with a gateway prefix (add `gateways:` first)")))

    return Policy(identities=dict(identities), secrets=dict(secrets), tests=tuple(tests),
                  files=tuple(p.file for p in parts), templates=dict(template_first),
                  gateways=tuple(gw for gw, _ in gateways),
                  webhooks=_merge_webhooks(parts, identities, problems),
                  budgets=_merge_budgets(parts, identities, problems),
                  prices=tuple(p for part in parts for p in part.prices))


_T = TypeVar("_T", Budget, Webhook)


def _merge_named(parts: list[_FilePart], identities: Mapping[str, Identity],
                 problems: list[PolicyProblem], kind: str,
                 defined: Callable[[_FilePart], Mapping[str, tuple[_T, Loc]]],
                 named: Callable[[Rule], str | None], field: tuple[str, str]) -> dict[str, _T]:
    """A top-level section of every file (`budgets:`, `webhooks:`: names unique across files),
    and every rule's reference to one of its names checked (`field` is where the rule names it).
    """
    found: dict[str, _T] = {}
    for part in parts:
        for name, (item, loc) in defined(part).items():
            first = found.get(name)
            if first is not None:
                problems.append(part.problem(loc, f"{kind} {name!r} is also defined at "
                                             f"{first.source}", f"give each {kind} one name"))
                continue
            found[name] = item
    for ident in identities.values():
        rule: Rule
        for rule in ident.rules:
            ref = named(rule)
            if ref is None or ref in found:
                continue
            problems.append(PolicyProblem(
                rule.source.file, rule.source.line, field_path((*rule.where, *field)),
                f"rule '{rule.name}' names {kind} {ref!r}, which is not defined",
                f"define it under `{kind}s:` (in any policy file); defined: "
                f"{', '.join(sorted(found)) or '(none)'}"))
    return found


def _merge_budgets(parts: list[_FilePart], identities: Mapping[str, Identity],
                   problems: list[PolicyProblem]) -> dict[str, Budget]:
    """`budgets:` of every file (names unique), and every `llm.budget` named there."""
    return _merge_named(parts, identities, problems, "budget", lambda p: p.budgets,
                        lambda r: r.llm.budget if r.llm is not None else None, ("llm", "budget"))


def _merge_webhooks(parts: list[_FilePart], identities: Mapping[str, Identity],
                    problems: list[PolicyProblem]) -> dict[str, Webhook]:
    """`webhooks:` of every file (names unique), and every ask rule's webhook named there."""
    return _merge_named(parts, identities, problems, "webhook", lambda p: p.webhooks,
                        lambda r: r.ask.webhook if r.ask is not None else None,
                        ("approval", "webhook"))


def _gateway_problem(part: _FilePart, loc: Loc,
                     problems: list[PolicyProblem]) -> Callable[[str, str], None]:
    def problem(message: str, fix: str) -> None:
        problems.append(part.problem((*loc, "prefix"), message, fix))
    return problem


_ONCE = ("description", "mode", "narrower_than", "limits", "owns")  # set in one file only


def _merge_identity(name: str, parts: list[_FilePart], templates: Mapping[str, list[Rule]],
                    template_first: Mapping[str, Source],
                    problems: list[PolicyProblem]) -> Identity | None:
    """One identity from every file that adds to it, in file order: in each file the rules of
    the templates it uses (in `use` order), then its own rules. None when a part is broken."""
    settings: dict[str, tuple[Any, Source]] = {}
    # each rule, with where its problems are reported and the template it came from
    placed: list[tuple[_FilePart, Loc, Rule, str | None]] = []
    used: dict[str, Source] = {}
    broken = False
    first: Source | None = None
    for part in parts:
        ipart = part.identities.get(name)
        if ipart is None:
            continue
        first = first or ipart.src
        base: Loc = ("identities", name)
        spec = ipart.spec
        if spec is None:
            broken = True
            continue
        for key in _ONCE:
            if key not in spec.model_fields_set:
                continue
            here = Source(part.file, part.line((*base, key)))
            prev = settings.get(key)
            if prev is not None:
                problems.append(part.problem(
                    (*base, key), f"`{key}` of identity {name!r} is also set in {prev[1]}",
                    f"set `{key}` in one of the identity's files only ({prev[1]} or {here})"))
                broken = True
                continue
            settings[key] = (getattr(spec, key), here)
        for j, tname in enumerate(spec.use or ()):
            uloc: Loc = (*base, "use", j)
            here = Source(part.file, part.line(uloc))
            if tname not in template_first:
                close = difflib.get_close_matches(tname, list(template_first), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                problems.append(part.problem(
                    uloc, f"unknown template {tname!r}",
                    f"{hint}define it under `templates:` (in any policy file) or fix the name; "
                    f"defined: {', '.join(sorted(template_first)) or '(none)'}"))
                broken = True
                continue
            if tname in used:
                problems.append(part.problem(
                    uloc, f"template {tname!r} is already used by identity {name!r} "
                    f"({used[tname]})", "use each template once per identity"))
                broken = True
                continue
            used[tname] = here
            placed += [(part, uloc, dataclasses.replace(r, identity=name), tname)
                       for r in templates.get(tname, ())]
        placed += [(part, (*base, "rules", i), r, None) for i, r in ipart.rules]

    rules = [r for _, _, r, _ in placed]

    def at(k: int, sub: Loc, message: str, fix: str) -> None:
        part, loc, rule, tname = placed[k]
        if tname is not None:  # a template's rule: reported at the identity's `use` entry
            problems.append(part.problem(loc, f"{message} (rule '{rule.name}' of template "
                                         f"{tname!r}, {rule.source})", fix))
        else:
            problems.append(part.problem((*loc, *sub), message, fix))

    check_rules(name, rules, at)
    owns = settings.get("owns")
    if owns is not None and not _check_owns(name, owns[0], owns[1], placed, problems):
        broken = True
    if broken or first is None:
        return None
    mode = settings.get("mode", ("enforce", first))[0]
    narrower = settings.get("narrower_than", (None, first))[0]
    lspec = settings.get("limits", (None, first))[0]
    # checked (and reported) where the file was read: compiling again cannot fail
    limits = compile_limits(lspec, (), lambda *_: None) if lspec is not None else None
    return Identity(name=name, rules=tuple(rules), source=first, mode=mode,
                    narrower_than=narrower, limits=limits,
                    owns=tuple(owns[0]) if owns is not None else None)


def _check_owns(name: str, owns: Sequence[str], where: Source,
                placed: Sequence[tuple[_FilePart, Loc, Rule, str | None]],
                problems: list[PolicyProblem]) -> bool:
    """`owns:` of an identity: every rule of it (its own or a template's through `use:`) comes
    from a file it names, or from the file that sets `owns`. False after reporting."""
    ok = True
    names = set(owns)
    for f in owns:
        if not f or f != Path(f).name or Path(f).suffix.lower() not in POLICY_SUFFIXES:
            ok = False
            problems.append(PolicyProblem(
                where.file, where.line, f"identities.{name}.owns",
                f"owns names {f!r}, which is not a policy file name",
                "list file names of the policy directory, e.g. owns: [20-agent.yaml]"))
    names.add(Path(where.file).name)
    reported_use: set[tuple[str, Loc]] = set()
    for part, loc, rule, tname in placed:
        fname = Path(part.file).name
        if fname in names or (part.file, loc) in reported_use:
            continue
        reported_use.add((part.file, loc))
        what = (f"`use: {tname}` adds template rules" if tname is not None
                else f"rule '{rule.name}' is added")
        problems.append(part.problem(
            loc, f"{what} to identity {name!r}, which only {', '.join(sorted(names))} may add "
            f"rules to (owns, {where})",
            f"move the rule into one of those files, or add {fname} to "
            f"identities.{name}.owns in {where.file} (a reviewed change)"))
        ok = False
    return ok


def _at_secret(parts: list[_FilePart], ref: SecretRef, key: str, msg: str,
               fix: str) -> PolicyProblem:
    for part in parts:
        if part.file == ref.source.file:
            return part.problem(("secrets", ref.name, key), msg, fix)
    return PolicyProblem(ref.source.file, ref.source.line, f"secrets.{ref.name}.{key}", msg, fix)


def _check_sign_scope(part: _FilePart, use: SecretUse, ref: SecretRef,
                      problems: list[PolicyProblem]) -> None:
    """A scope part neither the rule nor the secret names must be able to come from a host."""
    assert use.sign is not None and ref.aws is not None
    scope = resolve(use.sign, ref.aws, None)
    missing = [k for k, v in (("service", scope.service), ("region", scope.region)) if v is None]
    if missing and not hosts_may_give(use.hosts):
        what = " and ".join(missing)
        loc = use.loc[:-1] if use.loc[-1] == "secret" else use.loc  # at `sign:` itself
        problems.append(part.problem(
            loc, f"the SigV4 {what} of secret {use.name!r} is not named and none of the "
            f"rule's hosts ({', '.join(use.hosts) or '-'}) is an AWS endpoint to derive it from",
            f"write `inject: {{sign: {{secret: {use.name}, "
            + ", ".join(f"{k}: ..." for k in missing)
            + f"}}}}` (e.g. service: s3, region: eu-west-1), or add {what} under "
            f"secrets.{use.name}.aws"))


def _check_uses(part: _FilePart, uses: list[SecretUse], secrets: Mapping[str, object],
                problems: list[PolicyProblem], refs: Mapping[str, SecretRef]) -> None:
    for use in uses:
        ref = refs.get(use.name)
        if use.part == "sign" and ref is not None and ref.aws is None:
            problems.append(part.problem(
                use.loc, f"`sign` needs an `aws:` secret; {use.name!r} is not one",
                f"add `aws: {{region: ..., service: ...}}` under secrets.{use.name}, or name "
                "the aws secret"))
        elif use.part == "sign" and ref is not None and ref.aws is not None:
            _check_sign_scope(part, use, ref, problems)
        elif (use.part != "sign" and ref is not None and ref.aws is not None
              and use.loc[:1] != ("tests",)):  # a fixture naming it as injected is right
            problems.append(part.problem(
                use.loc, f"{use.name!r} is an `aws:` secret: it signs, it is never sent",
                f"write `inject: {{sign: {use.name}}}` instead"))
        elif use.part not in (None, "sign") and ref is not None and (
                ref.dynamic is None or ref.dynamic.username_field is None):
            problems.append(part.problem(
                use.loc, f"`{{{{ secrets.{use.name}.{use.part} }}}}` needs a dynamic secret "
                "with a username_field",
                f"add `username_field: username` under secrets.{use.name}.dynamic, or use "
                f"`{{{{ secrets.{use.name} }}}}`"))
        if use.name not in secrets:
            close = difflib.get_close_matches(use.name, list(secrets), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(part.problem(
                use.loc, f"secret {use.name!r} is not declared",
                f"{hint}declare it under `secrets:` (in any policy file) or fix the name; "
                f"declared: {', '.join(sorted(secrets)) or '(none)'}"))
