#!/usr/bin/env python3
"""Check that every relative link and backticked repository path in README.md and docs/*.md
points at a file or folder inside the repository, and that no document cites a file outside it
(NVFP4_SPEC.md, STYLE.md, ../shared/). Exit 1 naming each bad reference."""
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = ("NVFP4_SPEC.md", "STYLE.md", "../shared")


def main():
    bad = []
    for doc in ["README.md", *sorted(glob.glob("docs/*.md", root_dir=ROOT))]:
        text = open(os.path.join(ROOT, doc)).read()
        here = os.path.dirname(os.path.join(ROOT, doc))
        for name in OUTSIDE:
            if name in text:
                bad.append(f"{doc}: cites {name}, which is not in the repository")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = os.path.normpath(os.path.join(here, target.split("#")[0]))
            if not path.startswith(ROOT) or not os.path.exists(path):
                bad.append(f"{doc}: link {target} does not resolve to a file in the repository")
    print("\n".join(bad) or "all links resolve")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
