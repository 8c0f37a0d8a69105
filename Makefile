# kswitch — see README.md. Targets print what they run.
SHELL := /bin/bash
GO          ?= go
BIN         := bin
TOOLS       := $(CURDIR)/$(BIN)/tools
STATICCHECK := $(TOOLS)/staticcheck
# honnef.co/go/tools release that supports the Go in go.mod.
STATICCHECK_VERSION := v0.8.2
# Binaries the integration suite runs as real processes, cached between runs.
CACHE       ?= $(HOME)/.cache/kswitch
ETCD_VERSION = $(shell cd integration/tools/etcd && $(GO) list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
ETCD_DIR     = $(CACHE)/etcd-$(ETCD_VERSION)
VERSION     ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS     := -X github.com/kswitch/kswitch/internal/version.Version=$(VERSION)

.PHONY: all build test unit lint vet staticcheck fmt-check tools bench demo integration etcd-bin clean

all: build

## build: the kswitch binary into bin/kswitch
build:
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/kswitch ./cmd/kswitch

## test: lint, then every package's tests with the race detector
test: lint unit

unit:
	$(GO) test -race -count=1 ./...

## lint: go vet, staticcheck, gofmt
lint: vet staticcheck fmt-check

vet:
	$(GO) vet ./...

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...

fmt-check:
	@out=$$(gofmt -l $$(find . -name '*.go' -not -path './bin/*')); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

tools: $(STATICCHECK)

$(STATICCHECK):
	GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

## bench: benchmarks, each against a baseline measured in the same run
bench:
	$(GO) test -run '^$$' -bench . -benchtime 1x -count 1 ./... | tee $(BIN)/bench.txt | grep -E '^(Benchmark|pause|ok|FAIL|PASS)'

## demo: an embedded fleet: election, a leader crash, a clean hand-over
demo: build
	$(BIN)/kswitch demo

## integration: real etcd and kswitch processes, killed and restarted (build tag integration)
integration: build etcd-bin
	KSWITCH_TEST_BIN=$(CURDIR)/$(BIN)/kswitch KSWITCH_TEST_ETCD_DIR=$(ETCD_DIR) \
	$(GO) test -race -count=1 -tags integration -timeout 20m -v ./integration/...

## etcd-bin: the pinned etcd server and etcdctl (integration/tools/etcd/go.mod), built into $(CACHE)
etcd-bin:
	@if [ -x $(ETCD_DIR)/etcd ] && [ -x $(ETCD_DIR)/etcdctl ]; then echo "etcd $(ETCD_VERSION) cached in $(ETCD_DIR)"; else \
	  echo "building etcd $(ETCD_VERSION) into $(ETCD_DIR) (about 2 minutes, once)"; \
	  cd integration/tools/etcd && $(GO) build -o $(ETCD_DIR)/etcd go.etcd.io/etcd/server/v3 && \
	  $(GO) build -o $(ETCD_DIR)/etcdctl go.etcd.io/etcd/etcdctl/v3; fi

clean:
	rm -rf $(BIN)
