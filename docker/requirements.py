"""Print the package's requirements (pyproject.toml's dependencies and the named extras), one a line, so the image
installs its dependencies in a layer of their own before the source arrives.

    python3 docker/requirements.py pyproject.toml gpu,client,gateway > requirements.txt
"""

import sys
import tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = [e for e in sys.argv[2].split(",") if e] if len(sys.argv) > 2 else []
lines = list(project["dependencies"]) + [r for e in extras for r in project["optional-dependencies"][e]]
print("\n".join(dict.fromkeys(lines)))
