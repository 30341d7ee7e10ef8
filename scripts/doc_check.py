#!/usr/bin/env python3
"""Keeps the documentation true to the code (run by ctest as docs_check).

1. Snippets: a code block in docs/*.md preceded by
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


def check_snippets(update):
    problems = []
    for md in sorted((ROOT / "docs").glob("*.md")):
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
        if update and new != text:
            md.write_text(new)
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
            public = (None not in stack and bool(spaces) and spaces[0].startswith("dtrain")
                      and not set(spaces) & {"dp", "ddp", "fsdp", "detail"})
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
    files = [ROOT / "CMakeLists.txt", ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
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
        if f.parent != ROOT / "docs" and f.name != "README.md":
            for name in NOTE.findall(text):
                cited.setdefault(name, rel)
    for name, where in sorted(cited.items()):
        if name not in indexed:
            problems.append(f"docs/design.md: Note [{name}] ({where}) is not in the index of notes: add a row")
    for name in sorted(indexed - set(cited)):
        problems.append(f"docs/design.md: the index lists Note [{name}], which no code has any more: remove it")
    return problems


def main():
    update = "--update" in sys.argv[1:]
    problems = check_snippets(update) + check_api() + check_troubleshooting() + check_design_notes()
    for p in problems:
        print("doc_check: " + p)
    if not problems:
        print("doc_check: snippets, API names, troubleshooting messages and design notes are in step with the code")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
