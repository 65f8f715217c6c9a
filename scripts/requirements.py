#!/usr/bin/env python3
"""Print the requirements of pyproject.toml's groups, one per line: the one dependency list.

    python scripts/requirements.py build core test      # what to pip install
    python scripts/requirements.py --no-deps test       # what to pip install --no-deps

GROUP is `build` ([build-system] requires: what --no-build-isolation leaves to you), `core`
([project] dependencies) or a group of [project.optional-dependencies]; a group's dblast_ext[...]
references are expanded. --no-deps prints instead the groups' entries of [tool.dblast.no-deps]
(packages that ship data, whose declared dependencies are not needed), references followed too.
Each requirement is printed once, in the order met. Standard library only (Python 3.10 reads
TOML with the tomli that pip vendors).
"""
import argparse
import os
import re
import sys

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
# a reference to one of this project's own groups: dblast_ext[hf,eval]
REFERENCE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*\[([^\]]*)\]\s*$")


def load_toml(path):
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            try:
                from pip._vendor import tomli as tomllib
            except ImportError:
                sys.exit(f"{sys.argv[0]}: reading pyproject.toml needs Python 3.11+ (tomllib) "
                         "or the tomli package (pip install tomli)")
    with open(path, "rb") as f:
        return tomllib.load(f)


def normalise(name):
    return re.sub(r"[-_.]+", "-", name).lower()


class Groups:
    def __init__(self, pyproject):
        project = pyproject["project"]
        self.name = normalise(project["name"])
        self.optional = project.get("optional-dependencies", {})
        self.plain = {"build": pyproject["build-system"]["requires"], "core": project.get("dependencies", [])}
        self.no_deps = pyproject.get("tool", {}).get("dblast", {}).get("no-deps", {})
        unknown = sorted(set(self.no_deps) - set(self.optional))
        if unknown:
            sys.exit(f"[tool.dblast.no-deps] names groups that [project.optional-dependencies] lacks: {unknown}")

    def known(self):
        return list(self.plain) + list(self.optional)

    def expand(self, group, no_deps, seen):
        """The requirements of one group (or its --no-deps packages), references expanded."""
        if group in seen:
            return []
        seen.add(group)
        if group in self.plain:
            return [] if no_deps else list(self.plain[group])
        if group not in self.optional:
            sys.exit(f"unknown group {group!r}; the groups are: {', '.join(self.known())}")
        out = list(self.no_deps.get(group, [])) if no_deps else []
        for requirement in self.optional[group]:
            match = REFERENCE.match(requirement)
            if match and normalise(match.group(1)) == self.name:
                for ref in filter(None, (extra.strip() for extra in match.group(2).split(","))):
                    out += self.expand(ref, no_deps, seen)
            elif normalise(re.split(r"[\s\[<>=!~;@(]", requirement.strip(), maxsplit=1)[0]) == self.name:
                sys.exit(f"group {group!r}: only plain references to the project's groups are supported: {requirement!r}")
            elif not no_deps:
                out.append(requirement)
        return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="+", metavar="GROUP", help="build, core, or an optional-dependency group")
    parser.add_argument("--no-deps", action="store_true",
                        help="print the groups' [tool.dblast.no-deps] packages (for pip install --no-deps)")
    parser.add_argument("--pyproject", default=PYPROJECT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    groups = Groups(load_toml(args.pyproject))
    printed, seen = [], set()
    for group in args.groups:
        for requirement in groups.expand(group, args.no_deps, seen):
            if requirement not in printed:
                printed.append(requirement)
    if printed:
        print("\n".join(printed))


if __name__ == "__main__":
    main()
