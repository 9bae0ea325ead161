"""Every record and raw log the repository cites exists, and every one it holds is cited.

Citations are read from docs, READMEs and source comments: a path into benchmark_results/
(benchmark_results/NAME or benchmark_results/raw/NAME, with or without ../) must match a file;
a bare record name (a table's record column) cites the file it names. In a name, `{a,b}` stands
for both, and `*`, `<placeholder>` and a leading `...` for any text. A chart (.png) is also cited
through the record it was drawn from (the same name, .json). Run from anywhere:
`python3 tools/check_evidence.py` (`make check-evidence`); exits 1 listing what is missing or
orphaned.
"""

import fnmatch
import itertools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark_results"
SOURCES = ("*.md", "*.py", "*.sh", "*.cpp", "*.h", "*.cu", "*.cuh", "*.metal", "Makefile")
SKIP = {".git", ".venv", ".tools", ".gpu-kit", "build", "benchmark_results", "node_modules"}
NAME = re.compile(r"[\w.+<>*{},/-]+\.(?:json|png|txt|csv)\b")


def expand(name: str) -> list[str]:
    """`a-{1,2}-b` -> [`a-1-b`, `a-2-b`]; placeholders and `...` become `*`."""
    name = re.sub(r"<[^>]*>", "*", name.replace("...", "*"))
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def sources():
    for path in ROOT.rglob("*"):
        parts = set(path.relative_to(ROOT).parts[:-1])
        if path.is_file() and not parts & SKIP and any(path.match(p) for p in SOURCES):
            yield path


def main() -> int:
    held = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file()}
    cited, missing = {"README.md"}, []
    for path in sources():
        for token in NAME.findall(path.read_text(errors="replace")):
            path_like = "benchmark_results/" in token
            name = token.split("benchmark_results/")[-1] if path_like else token.split("/")[-1]
            matches = set()
            for pattern in expand(name):
                matches |= set(fnmatch.filter(held, pattern))
                if not path_like:  # a bare name: a record or a raw log of that name
                    matches |= set(fnmatch.filter(held, "raw/" + pattern))
            cited |= matches
            if path_like and not matches:
                missing.append(f"{path.relative_to(ROOT)}: {token}")
    cited |= {name for name in held if name.endswith(".png") and name[:-4] + ".json" in cited}
    orphaned = sorted(held - cited)
    for line in missing:
        print(f"cited, not there: {line}")
    for name in orphaned:
        print(f"there, not cited: benchmark_results/{name}")
    print(f"{len(held)} files in benchmark_results/, {len(cited)} cited, {len(missing)} missing")
    return 1 if missing or orphaned else 0


if __name__ == "__main__":
    sys.exit(main())
