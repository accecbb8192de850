"""Rewrite README.md's config reference (the tables under "## Config reference", generated from launcher/core/config.py's
dataclasses and their docstrings): `python scripts/config_reference.py`. tests/unit/test_config.py checks it is current."""

from pathlib import Path

from launcher.core.config import reference_markdown

readme = Path(__file__).resolve().parent.parent / "README.md"
text = readme.read_text()
start = text.index("**`slurm`**")
end = text.index("\n## ", start)
new = text[:start] + reference_markdown().strip() + "\n" + text[end:]
readme.write_text(new)
print(f"README.md: config reference {'rewritten' if new != text else 'already current'}")
