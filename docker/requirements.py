"""Print the requirements pyproject.toml declares, one per line: the base dependencies,
or with an argument those of that extra (docker/Dockerfile installs them in a layer
of their own, before the code, so that a code change does not reinstall them)."""
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
wanted = project["optional-dependencies"][sys.argv[1]] if len(sys.argv) > 1 else project["dependencies"]
print("\n".join(wanted))
