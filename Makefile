# Build and test plumbing. `make test` works from a fresh clone: it makes .venv, installs the
# package with its extras (once per pyproject.toml change), gets a llama-server (built once into
# the user cache), then runs pytest. `make lint` and `make demo` reuse the same install.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# llama-cpp-python (the `gguf` extra) compiles llama.cpp; only its library is needed.
export CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF

.PHONY: test lint demo install chromium llama-server

test: install chromium llama-server
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy proxy

demo: install
	$(BIN)/slotwise demo

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The stamp makes a warm `make test` skip pip entirely until pyproject.toml changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[dev,gguf,plot,cluster]'
	touch $@

llama-server: install
	$(BIN)/slotwise testbed server

# Browser tests need chromium; install it only when we can (root with apt), else tests say so.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium for the browser tests"; \
		(apt-get update -qq && apt-get install -y -qq chromium) \
			|| echo "chromium could not be installed; browser tests will say so"; \
	fi
