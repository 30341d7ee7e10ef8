#!/usr/bin/env python3
"""Keeps the documentation true to the code (run by ctest as docs_check).

1. Snippets: a code block in docs/**/*.md (docs/tutorial/ holds the tutorial, a file per section)
   preceded by
       <!-- snippet: examples/ddp_train.cpp#wrap -->
   must equal the region of that file between the lines `// doc:begin wrap` and `// doc:end wrap`
   (dedented); one preceded by `<!-- snippet: examples/slurm/train_fashion_mnist.sbatch -->` (no
   region) must equal the whole file, for files whose first line cannot be a marker (a batch script's
   `#!`). The examples are compiled and run by the test suite, so the documentation shows only code
   that builds and works. `--update` rewrites the blocks from the sources.
2. API reference: every class, struct and free function declared at namespace level in a public
   header (include/dtrain/*.h and include/dtrain/datasets/*.h, not detail/) is named in docs/api.md.
3. Troubleshooting: every error line of the bad-input catalogue (docs/bad_input.md, which README
   carried before) appears in docs/troubleshooting.md.
4. Design notes: every `Note [Name]` cited in the code has a row in docs/design.md's index, every row
   names a note the code still has, and nothing cites a design document outside the repository or
   an issue number (a comment says the reason itself).
5. The PyTorch page (docs/pytorch_to_dtrain.md), the first page a PyTorch user reads, says "not
   supported" in one way only: a table row whose dtrain column is `not supported` (every name of its
   PyTorch column), or "`NAME`, ...: not supported" in a cell (the names since the clause began).
   Each such name must be absent from the code: an API name or `keyword=` from the declarations of
   include/dtrain/ (a keyword from those of the row's own dtrain functions and option structs), a
   variable from src/common/env.cpp's table, a `--flag` (or `--flag VALUE`, when --help names the
   value) from what tools/dtrain-run declares (CLI11's add_option/add_flag, the flag table's rows,
   the arguments compared by hand). Conversely every `--flag` the launcher table gives dtrain-run, and
   every `dtrain::name` the page shows, must exist. Other wordings of "missing" ("not there",
   "unsupported") are refused, so that no claim escapes the check.

6. The front door: README.md stays within README_LINES lines (the details live in docs/ and
   SECURITY.md, which it links), and its first two commands are `./scripts/demo.sh` (the main job)
   and `./scripts/test.sh` (every test).

Exit status 1 with one line per problem, naming the file and what to do.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SNIPPET = re.compile(r"<!-- snippet: (?P<file>[^#\s]+)(?:#(?P<name>[\w-]+))? -->\n```(?P<lang>\w*)\n(?P<body>.*?)```",
                     re.S)


def region(path, name):
    """The dedented lines between `doc:begin name` and `doc:end name` in path, or None."""
    lines = (ROOT / path).read_text().splitlines()
    begin = [i for i, l in enumerate(lines) if re.search(r"doc:begin %s\s*$" % re.escape(name), l)]
    end = [i for i, l in enumerate(lines) if re.search(r"doc:end %s\s*$" % re.escape(name), l)]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        return None
    body = [l for l in lines[begin[0] + 1:end[0]] if "doc:begin" not in l and "doc:end" not in l]
    indent = min((len(l) - len(l.lstrip()) for l in body if l.strip()), default=0)
    return "".join(l[indent:] + "\n" for l in body)


def doc_pages():
    """docs/'s pages, those of its folders too (the tutorial is docs/tutorial/, one file per section)."""
    return sorted((ROOT / "docs").rglob("*.md"))


def check_snippets(update):
    problems, shown = [], 0
    for md in doc_pages():
        text = md.read_text()

        def fix(m):
            path, name = m["file"], m["name"]
            if not (ROOT / path).is_file():
                problems.append(f"{md.relative_to(ROOT)}: snippet source {path} does not exist: fix the path")
                return m[0]
            want = (ROOT / path).read_text() if name is None else region(path, name)
            if want is None:
                problems.append(f"{md.relative_to(ROOT)}: {path} has no single region `// doc:begin {name}` .. "
                                f"`// doc:end {name}`: add the markers or fix the name")
                return m[0]
            if m["body"] != want:
                ref = path if name is None else f"{path}#{name}"
                if not update:
                    problems.append(f"{md.relative_to(ROOT)}: snippet {ref} differs from the source: "
                                    f"run scripts/doc_check.py --update")
                return f"<!-- snippet: {ref} -->\n```{m['lang']}\n{want}```"
            return m[0]

        new = SNIPPET.sub(fix, text)
        shown += len(SNIPPET.findall(text))
        if update and new != text:
            md.write_text(new)
    if not shown:
        problems.append("docs/: no page shows a snippet (<!-- snippet: FILE#REGION --> before a code block): "
                        "the tutorial's C++ must be cut from the tested examples")
    return problems


def public_names():
    """(header, name) for namespace-level classes, structs, enums and functions of the public headers."""
    names = []
    headers = sorted((ROOT / "include/dtrain").glob("*.h")) + sorted((ROOT / "include/dtrain/datasets").glob("*.h"))
    for h in headers:
        stack = []  # one entry per open brace: the namespace's name, or None for any other brace
        for line in h.read_text().splitlines():
            code = re.sub(r"//.*", "", line)
            spaces = [b for b in stack if b is not None]
            # Namespace level of dtrain's public namespaces (not the implementation's dp, ddp, detail).
            # A nested namespace definition (namespace detail::fsdp) counts as each of its names.
            parts = {part for s in spaces for part in s.split("::")}
            public = (None not in stack and bool(spaces) and spaces[0].startswith("dtrain")
                      and not parts & {"dp", "ddp", "fsdp", "detail"})
            if public and not re.match(r"\s*(namespace|#)", code):
                m = re.match(r"\s*(?:template\s*<[^>]*>\s*)?(?:class|struct|enum class|enum)\s+(?:\[\[[^\]]*\]\]\s*)?"
                             r"(?:DTRAIN_\w+\s+)?(\w+)\s*(?:final\s*)?(?:[:{]|$)", code)
                if m:
                    names.append((h.relative_to(ROOT), m[1]))
                else:
                    f = re.match(r"\s*(?:inline\s+|static\s+|constexpr\s+|\[\[nodiscard\]\]\s+)*[\w:<>,\s\*&]+?[\s\*&]"
                                 r"(\w+)\s*\(", code)
                    if f and not re.match(r"\s*(return|using|typedef|if|for|while)\b", code) and f[1] not in (
                            "operator", "TORCH_MODULE"):
                        names.append((h.relative_to(ROOT), f[1]))
            ns = re.match(r"\s*namespace\s+([\w:]+)\s*{", code)
            for i, ch in enumerate(c for c in code if c in "{}"):
                if ch == "{":
                    stack.append(ns[1] if ns and i == 0 else None)
                elif stack:
                    stack.pop()
    return names


def check_api():
    api = ROOT / "docs/api.md"
    if not api.is_file():
        return ["docs/api.md is missing: write the API reference"]
    text = api.read_text()
    seen, problems = set(), []
    for header, name in public_names():
        if name in seen:
            continue
        seen.add(name)
        if not re.search(r"\b%s\b" % re.escape(name), text):
            problems.append(f"docs/api.md does not mention {name} (declared in {header}): document it")
    return problems


def check_troubleshooting():
    catalogue = ROOT / "docs/bad_input.md"
    page = ROOT / "docs/troubleshooting.md"
    if not page.is_file():
        return ["docs/troubleshooting.md is missing: write the troubleshooting page"]
    if not catalogue.is_file():
        return ["docs/bad_input.md is missing: write the bad-input catalogue"]
    text = page.read_text()
    section = catalogue.read_text().split("# Bad-input catalogue", 1)
    if len(section) != 2:
        return ["docs/bad_input.md has no '# Bad-input catalogue' heading"]
    problems, rows = [], 0
    for row in section[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[2].startswith("`"):
            continue
        rows += 1
        message = cells[2].strip("`")
        if message not in text:
            problems.append(f"docs/troubleshooting.md lacks the catalogue error `{message}` (docs/bad_input.md): "
                            f"add it with its remedy")
    if not rows:
        problems.append("docs/bad_input.md: its catalogue table has no rows (area | wrong input | `error line` | test)")
    return problems


CODE_DIRS = ("src", "include", "tools", "tests", "examples", "bench", "scripts", "cmake")
NOTE = re.compile(r"Note \[([^\]\n]+)\]")
SPLIT_NOTE = re.compile(r"Note \[[^\]\n]*\n")  # grep cannot find a name split over two lines
OUTSIDE = re.compile(r"\.\./shared/|\bDESIGN\.md\b")  # the design once lived beside the repository
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+")


def project_files():
    files = [ROOT / "CMakeLists.txt", ROOT / "README.md"] + doc_pages()
    for d in CODE_DIRS:
        files += sorted(f for f in (ROOT / d).rglob("*") if f.is_file() and f.suffix in
                        (".h", ".cpp", ".py", ".sh", ".txt", ".md", ".in", ".cmake", ""))
    return [f for f in files if f.is_file() and f != pathlib.Path(__file__).resolve()]


def check_design_notes():
    design = ROOT / "docs/design.md"
    if not design.is_file():
        return ["docs/design.md is missing: write the design page with its index of notes"]
    indexed = set(re.findall(r"^\| \[([^\]]+)\] \|", design.read_text(), re.M))
    cited, problems = {}, []
    for f in project_files():
        text = f.read_text(errors="replace")
        rel = f.relative_to(ROOT)
        if OUTSIDE.search(text):
            problems.append(f"{rel} cites a design document outside the repository: point to docs/design.md")
        if ISSUE.search(text):
            problems.append(f"{rel} cites an issue number ({ISSUE.search(text)[0]!r}): say the reason instead")
        if SPLIT_NOTE.search(text):
            problems.append(f"{rel} splits a Note [..] name over two lines: keep it on one so grep finds it")
        if ROOT / "docs" not in f.parents and f.name != "README.md":
            for name in NOTE.findall(text):
                cited.setdefault(name, rel)
    for name, where in sorted(cited.items()):
        if name not in indexed:
            problems.append(f"docs/design.md: Note [{name}] ({where}) is not in the index of notes: add a row")
    for name in sorted(indexed - set(cited)):
        problems.append(f"docs/design.md: the index lists Note [{name}], which no code has any more: remove it")
    return problems


PAGE = "docs/pytorch_to_dtrain.md"
CPP_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "alignof", "alignas", "noexcept",
                "static_assert", "operator", "defined", "catch", "throw", "new", "delete", "typeid", "explicit",
                "DTRAIN_ARG", "TORCH_MODULE", "DTRAIN_CHECK", "DTRAIN_ASSERT"}
CPP_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"')


def strip_cpp(text, keep_strings=False):
    """C++ code without comments (and without string and character literals unless keep_strings)."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(" ")
        elif text[i] in "\"'":
            m = re.compile(r'%s(?:\\.|[^%s\\\n])*%s' % ((text[i],) * 3)).match(text, i)
            end = m.end() if m else i + 1
            out.append(text[i:end] if keep_strings else text[i] * 2)
            i = end
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def balanced(code, open_at):
    """The text inside the bracket at code[open_at] and its matching close, or None (brackets inside
    string literals do not count)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[code[open_at]]]
    j = open_at
    while j + 1 < len(code):
        j += 1
        c = code[j]
        if c == '"':
            m = CPP_STRING.match(code, j)
            j = m.end() - 1 if m else j
        elif c in pairs:
            stack.append(pairs[c])
        elif c in ")}]":
            if c != stack.pop():
                return None
            if not stack:
                return code[open_at + 1:j]
    return None


def split_top(text, sep=","):
    """text split at `sep` outside brackets and template arguments."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth = max(0, depth - 1)
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


class Declarations:
    """What include/dtrain/ declares, as far as the PyTorch page's claims need: `names` (classes, structs,
    enums and their values, functions and methods, aliases, constants; name -> its header and dtrain's
    spelling, PyTorch's ScheduleGPipe being dtrain's Schedule::kGPipe), `options`
    (struct -> its DTRAIN_ARG options), and `params` (function or constructor -> its parameters' names
    and the types they name)."""

    def __init__(self):
        self.names, self.options, self.params, self.param_types = {}, {}, {}, {}
        self.namespaces, self.option_owner = set(), {}  # option -> (header, "Struct::option")
        headers = sorted((ROOT / "include/dtrain").glob("*.h")) + sorted((ROOT / "include/dtrain/datasets").glob("*.h"))
        for h in headers:
            code = strip_cpp(h.read_text())
            rel = str(h.relative_to(ROOT))
            self.namespaces |= set(re.findall(r"\bnamespace\s+([\w:]+)", code))
            found = set(re.findall(r"\b(?:class|struct|enum(?:\s+class)?)\s+(?:\[\[[^\]]*\]\]\s*)?(\w+)", code))
            found |= set(re.findall(r"\bTORCH_MODULE\((\w+)\)", code))
            found |= set(re.findall(r"\busing\s+(\w+)\s*=", code))
            found |= set(re.findall(r"\bconstexpr\s+[\w:<>,\s]*?\b(\w+)\s*(?:=|\{)", code))
            for enum, body in re.findall(r"\benum\s+(?:class\s+)?(\w+)\s*(?::\s*[\w:]+\s*)?\{([^}]*)\}", code):
                for value in [m[1] for m in (re.match(r"\s*(\w+)", e) for e in body.split(",")) if m]:
                    found.add(value)
                    # PyTorch's class for a dtrain enum value: ScheduleInterleaved1F1B is Schedule::kInterleaved1F1B.
                    if re.match(r"k[A-Z0-9]", value):
                        self.names.setdefault(enum + value[1:], (rel, f"{enum}::{value}"))
            for m in re.finditer(r"\b([A-Za-z_]\w*)\s*\(", code):
                name = m[1]
                if name in CPP_KEYWORDS:
                    continue
                found.add(name)
                inside = balanced(code, m.end() - 1)
                for param in split_top(inside or ""):
                    decl = split_top(param, "=")[0] if "=" in param else param
                    idents = re.findall(r"[A-Za-z_]\w*", decl)
                    if idents:
                        self.params.setdefault(name, set()).add(idents[-1])
                        self.param_types.setdefault(name, set()).update(idents[:-1])
            for m in re.finditer(r"\bstruct\s+(\w+)\s*\{", code):
                body = balanced(code, m.end() - 1) or ""
                for a in re.finditer(r"\bDTRAIN_ARG\(", body):
                    args = split_top(balanced(body, a.end() - 1) or "")
                    if len(args) >= 2:
                        self.options.setdefault(m[1], set()).add(args[1])
                        self.option_owner.setdefault(args[1], (rel, f"{m[1]}::{args[1]}"))
            for name in found - CPP_KEYWORDS:
                self.names.setdefault(name, (rel, name))

    def all_options(self):
        return set().union(*self.options.values())

    def scope(self, functions):
        """The keywords that `functions` (dtrain functions, constructors, option structs) take."""
        out = set()
        for f in functions:
            out |= self.params.get(f, set()) | self.options.get(f, set())
            for t in self.param_types.get(f, ()):
                out |= self.options.get(t, set())
        return out


class Launcher:
    """The flags tools/dtrain-run takes (flag -> the --help text of its option, "" for one matched by hand)."""

    FLAG_LIST = re.compile(r"-{1,2}[A-Za-z][\w-]*(?:,-{1,2}[A-Za-z][\w-]*)*")

    def __init__(self):
        self.help = {}
        for f in sorted((ROOT / "tools/dtrain-run").glob("*.cpp")):
            code = strip_cpp(f.read_text(), keep_strings=True)
            # CLI11: app.add_option("--a,--b", var, "help") / add_flag(...).
            for m in re.finditer(r"\badd_(?:option|flag)\s*\(", code):
                self._declare(CPP_STRING.findall(balanced(code, m.end() - 1) or ""))
            # The flag table (options.cpp's NumericFlag rows): a brace list whose first item is a flag list.
            for m in re.finditer(r'\{\s*(?="-)', code):
                self._declare(CPP_STRING.findall(balanced(code, m.start()) or ""))
            # Arguments matched by hand: a == "--version", argv[1].rfind("--analyze", 0) == 0.
            for flag in re.findall(r'(?:==\s*|\brfind\(\s*)"(-{1,2}[A-Za-z][\w-]*)=?"', code):
                self.help.setdefault(flag, "")

    def _declare(self, literals):
        if not literals or not self.FLAG_LIST.fullmatch(literals[0][1:-1]):
            return
        text = " ".join(s[1:-1] for s in literals[1:])
        for flag in literals[0][1:-1].split(","):
            self.help[flag] = self.help.get(flag, "") + " " + text

    def takes_value(self, flag, value):
        return re.search(r"(?<![\w:-])%s(?![\w:-])" % re.escape(value), self.help.get(flag, "")) is not None


def environment_names():
    """The variables of src/common/env.cpp's table, the only code that reads the environment."""
    code = strip_cpp((ROOT / "src/common/env.cpp").read_text(), keep_strings=True)
    return set(re.findall(r'[({]\s*"([A-Z][A-Z0-9_]+)"', code))


def code_literals():
    """Every string literal of include/dtrain/ and src/."""
    out = set()
    for d in ("include/dtrain", "src"):
        for f in (ROOT / d).rglob("*"):
            if f.suffix in (".h", ".cpp"):
                out |= {s[1:-1] for s in CPP_STRING.findall(strip_cpp(f.read_text(errors="replace"), True))}
    return out


def table_cells(line):
    """A table row's cells, split at the | outside code spans."""
    cells, cur, in_code = [], [], False
    for c in line.strip().strip("|"):
        if c == "`":
            in_code = not in_code
        if c == "|" and not in_code:
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    cells.append("".join(cur).strip())
    return cells


def code_spans(text):
    return re.findall(r"`([^`]+)`", text)


def unsupported_clauses(cell):
    """The code spans of each "`A`, `B`: not supported" clause of a cell: those since the clause began
    (the cell's start, or the last '. ', '; ' or ': ' outside code spans)."""
    spans = []

    def hide(m):
        spans.append(m[1])
        return "\0%d\0" % (len(spans) - 1)

    text = re.sub(r"`([^`]+)`", hide, cell)
    for m in re.finditer(r":\s*not supported", text):
        start = max(text.rfind(b, 0, m.start()) for b in (". ", "; ", ": "))
        clause = text[start + 1 if start >= 0 else 0:m.start()]
        yield [spans[int(i)] for i in re.findall(r"\0(\d+)\0", clause)]


def claim(span, section):
    """What a span in a not-supported clause names: (kind, name, detail)."""
    s = span.strip()
    if s.startswith("-"):
        flag, value = (re.split(r"[\s=]", s, maxsplit=1) + [""])[:2]
        return "flag", flag, value.strip()
    if section.startswith("Launcher"):
        return "unreadable", s, "a launcher claim names its flag: write `--flag` or `--flag VALUE`"
    if section.startswith("Environment") and re.fullmatch(r"[A-Z][A-Z0-9_]*", s):
        return "variable", s, None
    if re.fullmatch(r'"[^"]+"', s):
        return "value", s[1:-1], None
    m = re.fullmatch(r"(\w+)=", s)
    if m:
        return "keyword", m[1], None
    qualified = r"\w+(?:(?:\.|::)\w+)*"  # dist.all_gather, Schedule::kGPipe
    m = re.fullmatch(r"(%s)\((.*)\)" % qualified, s)
    if m:
        function = re.split(r"\.|::", m[1])[-1]
        keywords = re.findall(r"(\w+)\s*=", m[2])
        if keywords:
            return "keywords", keywords, function
        return "name", function, None
    if re.fullmatch(qualified, s):
        return "name", re.split(r"\.|::", s)[-1], None
    return "unreadable", s, "write an API name, `keyword=`, `--flag` or `--flag VALUE`, or a variable"


def check_pytorch_page():
    page = ROOT / PAGE
    if not page.is_file():
        return [f"{PAGE} is missing: write the PyTorch-to-dtrain page"]
    decl, launcher, env_names = Declarations(), Launcher(), environment_names()
    literals = None
    problems, section = [], ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        where = f"{PAGE}:{number}"
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("|") or re.fullmatch(r"\|[-|\s]+\|?", line.strip()):
            continue
        cells = table_cells(line)
        if len(cells) < 3 or cells[0] in ("PyTorch", "torchrun", "PyTorch / tutorial"):
            continue
        row_unsupported = cells[1] == "not supported"
        # One wording: other ways of saying "missing" would escape the check.
        for cell in cells:
            for m in re.finditer(r"not supported|not there|unsupported|not available", cell):
                if cell[:m.start()].count("`") % 2:
                    continue  # inside a code span
                if m[0] == "not supported" and (cell == "not supported" or cell[:m.start()].rstrip().endswith(":")):
                    continue
                problems.append(f"{where}: '{m[0]}' in free words (...{cell[max(0, m.start() - 60):m.end()]}): "
                                f"write `NAME`, ...: not supported, or a row whose dtrain column is `not supported`, "
                                f"so that doc_check can hold the names to the code")
        # What the row says dtrain lacks.
        claims = []
        if row_unsupported:
            claims.append((code_spans(cells[0]), set()))
        functions = set(re.findall(r"(\w+)\s*\(", " ".join(code_spans(cells[1]))))
        functions |= {w for w in re.findall(r"\w+", " ".join(code_spans(cells[1]))) if w in decl.options}
        for cell in cells[1:] if row_unsupported else cells:
            for names in unsupported_clauses(cell):
                claims.append((names, functions))
        for names, row_functions in claims:
            for span in names:
                kind, name, detail = claim(span, section)
                if kind == "name" and (name in decl.names or name in decl.option_owner):
                    header, spelling = decl.names.get(name) or decl.option_owner[name]
                    remedy = "give it a row of its own with its dtrain counterpart"
                    if name not in decl.names:
                        remedy += f" (a keyword of this row's function only: write `{name}=`)"
                    problems.append(f"{where}: `{span}` is said to be not supported, but {header} declares {spelling}: "
                                    f"{remedy}")
                elif kind in ("keyword", "keywords"):
                    for keyword in [name] if kind == "keyword" else name:
                        owners = {detail} if detail in decl.params else row_functions
                        scope = decl.scope(owners) if owners else set()
                        if not scope:
                            scope = decl.all_options() | set(decl.names)
                        if keyword in scope:
                            takers = ", ".join(sorted(owners)) or "an option"
                            problems.append(f"{where}: `{span}` is said to be not supported, but dtrain takes "
                                            f"{keyword} (include/dtrain/, {takers}): say what it does instead")
                elif kind == "flag" and name in launcher.help and (not detail or launcher.takes_value(name, detail)):
                    what = f"{name} {detail}" if detail else name
                    problems.append(f"{where}: `{span}` is said to be not supported, but dtrain-run takes {what} "
                                    f"(tools/dtrain-run/, its --help): give it a row of its own saying what it does")
                elif kind == "variable" and name in env_names:
                    problems.append(f"{where}: `{span}` is said to be not supported, but dtrain reads {name} "
                                    f"(src/common/env.cpp): say what it does (docs/environment.md)")
                elif kind == "value":
                    if literals is None:
                        literals = code_literals()
                    if name in literals:
                        problems.append(f"{where}: `{span}` is said to be not supported, but the code spells the "
                                        f"value \"{name}\" (include/dtrain/ or src/): check what it does and say so")
                elif kind == "unreadable":
                    problems.append(f"{where}: cannot tell what `{span}` names in a not-supported claim: {detail}, "
                                    f"so that doc_check can check it")
        # The flags the launcher table gives dtrain-run must be ones it takes.
        if section.startswith("Launcher") and not row_unsupported:
            given = code_spans(cells[1]) + (code_spans(cells[0]) if cells[1].startswith("the same") else [])
            for span in given:
                if span.startswith("-"):
                    flag = re.split(r"[\s=]", span, maxsplit=1)[0]
                    if flag not in launcher.help:
                        problems.append(f"{where}: `{span}`: dtrain-run takes no {flag} (tools/dtrain-run/ declares "
                                        f"none): fix the flag, or move it to the not-supported row")
        # Every dtrain:: name the page shows exists.
        for span in code_spans(line):
            for name in re.findall(r"\bdtrain::(?:\w+::)*(\w+)", span):
                if name not in decl.names and not any(name in n.split("::") for n in decl.namespaces):
                    problems.append(f"{where}: `{span}` names dtrain::{name}, which include/dtrain/ does not declare: "
                                    f"fix the name")
    return problems


README_LINES = 300


def check_readme():
    text = (ROOT / "README.md").read_text()
    problems = []
    lines = text.count("\n")
    if lines > README_LINES:
        problems.append(f"README.md has {lines} lines, over its budget of {README_LINES}: move the detail to docs/ "
                        "(features.md, benchmarks.md, the tutorial) and link it")
    commands = re.findall(r"^(\./scripts/\S+)", text, re.M)[:2]
    if commands != ["./scripts/demo.sh", "./scripts/test.sh"]:
        problems.append(f"README.md's first two commands are {commands}, not ['./scripts/demo.sh', "
                        "'./scripts/test.sh']: keep the main job and every test first")
    if "(SECURITY.md)" not in text:
        problems.append("README.md does not link SECURITY.md (the trust model): keep a few lines and the link")
    return problems


def main():
    update = "--update" in sys.argv[1:]
    problems = (check_snippets(update) + check_api() + check_troubleshooting() + check_design_notes() +
                check_pytorch_page() + check_readme())
    for p in problems:
        print("doc_check: " + p)
    if not problems:
        print("doc_check: snippets, API names, troubleshooting messages, design notes and the PyTorch page's "
              "not-supported claims are in step with the code; README is within its budget")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
