# One entry point for checks, tests and benchmarks. PYTHON defaults to the project venv.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

.PHONY: check test bench develop fmt

develop:
	$(PYTHON) -m maturin develop --release

check:
	$(PYTHON) -m ruff check python tests benches
	$(PYTHON) -m ruff format --check python tests benches
	$(PYTHON) -m mypy python/shardline
	@if $(PYTHON) -c "import shardline._native" 2>/dev/null; then \
		$(PYTHON) -m mypy.stubtest shardline._native; \
	else echo "stubtest skipped: shardline._native is not built (make develop)"; fi
	cargo fmt --all --check
	cargo clippy --all-targets --all-features -- -D warnings
	cargo test

test:
	cargo test
	$(PYTHON) -m pytest -q

bench:
	$(PYTHON) benches/bench_collectives.py --ranks 2
	$(PYTHON) benches/bench_ddp.py --ranks 2 4
	cargo bench

fmt:
	$(PYTHON) -m ruff format python tests benches
	$(PYTHON) -m ruff check --fix python tests benches
	cargo fmt --all
