# The two commands of the README. Both create the environment first when it is missing.
PY := .venv/bin/python

.PHONY: book test setup bench

setup:
	@bash scripts/setup.sh

book: setup
	$(PY) -m sinkbook.book build --profile default

test: setup
	$(PY) -m pytest -q -m "not browser"
	$(PY) -m sinkbook.book build --profile quick
	SINKBOOK_REQUIRE_BOOK=1 SINKBOOK_BOOK_HTML=_build/quick/html $(PY) -m pytest -q -m browser

bench: setup
	$(PY) scripts/bench_capture.py
