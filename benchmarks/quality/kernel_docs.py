"""A second corpus for the scaling law's checks (issue 70): the Linux kernel's documentation as English prose.

The law must predict on corpora it was not fitted on, in the regime of the embedded one (1-4 passes at 1,200 s on
this machine): neither Python code nor tiny-shakespeare (too small). Debian's linux-doc-6.1 carries the kernel's
Documentation/ as reStructuredText (3,183 files, 24 MB); each file's prose (peers.rst_prose: directives, literal
blocks, tables and heading underlines left out) becomes one document of the folder this writes, which
`rpt prepare --input OUT --out data/kdocs` prepares.

    apt-get install linux-doc-6.1
    .venv/bin/python benchmarks/quality/kernel_docs.py OUT
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import rst_prose  # noqa: E402

DOCS = Path("/usr/share/doc/linux-doc-6.1/Documentation")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder of .txt documents to write")
    args = parser.parse_args()
    if not DOCS.is_dir():
        raise SystemExit(f"{DOCS} is missing: apt-get install linux-doc-6.1")
    args.out.mkdir(parents=True, exist_ok=True)
    written = 0
    for source in sorted(DOCS.rglob("*.rst.gz")):
        prose = rst_prose(gzip.decompress(source.read_bytes()).decode("utf-8", errors="replace"))
        if len(prose) < 200:  # an index page: its toctree only
            continue
        name = "_".join(source.relative_to(DOCS).with_suffix("").with_suffix("").parts) + ".txt"
        (args.out / name).write_text(prose, encoding="utf-8")
        written += len(prose.encode())
    print(f"{args.out}: {len(list(args.out.glob('*.txt')))} documents, {written / 1e6:.1f} MB of prose")


if __name__ == "__main__":
    main()
