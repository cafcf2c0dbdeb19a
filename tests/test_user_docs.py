"""What users read cites what users have (issue 48 item 5): the tutorials, the README and the JSON schemas of the
files users write cite the paper's sections or the SDK's own docs, never "SPEC §" (a design document that is not
shipped)."""
from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CITES_SPEC = re.compile(r"\bSPEC(?:\.md)?\s*(?:§|\\u00a7|name)")


def test_tutorials_and_readme_cite_no_spec_document() -> None:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "tutorials").glob("*.ipynb"))]:
        texts = ([path.read_text()] if path.suffix == ".md" else
                 ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]])
        found += [f"{path.name}: ...{t[max(0, m.start() - 40):m.end() + 20]}..." for t in texts
                  for m in CITES_SPEC.finditer(t)]
    assert not found, "\n".join(found)


def test_the_schemas_users_see_cite_no_spec_document() -> None:
    from hspmd_sdk.core.plan import AnnotationPlan
    from hspmd_sdk.core.strategy import Strategy

    for model in (Strategy, AnnotationPlan):
        text = json.dumps(model.model_json_schema())
        assert not CITES_SPEC.search(text), (model.__name__, CITES_SPEC.search(text))
