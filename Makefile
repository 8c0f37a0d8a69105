# kswitch — see README.md. Targets print what they run.
GO          ?= go
BIN         := bin
TOOLS       := $(CURDIR)/$(BIN)/tools
STATICCHECK := $(TOOLS)/staticcheck
# honnef.co/go/tools release that supports the Go in go.mod.
STATICCHECK_VERSION := v0.8.2
VERSION     ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS     := -X github.com/kswitch/kswitch/internal/version.Version=$(VERSION)

.PHONY: all build test unit lint vet staticcheck fmt-check tools demo integration clean

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
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

tools: $(STATICCHECK)

$(STATICCHECK):
	GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

## demo: an embedded fleet: election, a leader crash, a clean hand-over
demo: build
	$(BIN)/kswitch demo

## integration: kswitch processes killed and restarted (build tag integration)
integration: build
	$(GO) test -race -count=1 -tags integration -timeout 20m ./integration/...

clean:
	rm -rf $(BIN)
