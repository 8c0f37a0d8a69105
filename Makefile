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
# promtool tests the alert rules (deploy/prometheus); built from the
# Prometheus module once, into the cache.
PROMTOOL_VERSION := v0.316.0
PROMTOOL    := $(CACHE)/promtool-$(PROMTOOL_VERSION)/promtool
ETCD_VERSION = $(shell cd integration/tools/etcd && $(GO) list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
ETCD_DIR     = $(CACHE)/etcd-$(ETCD_VERSION)
# Kafka broker and MirrorMaker 2 jars (integration/kafka/pom.xml pins the version).
KAFKA_POM     = integration/kafka/pom.xml
KAFKA_VERSION = $(shell sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' $(KAFKA_POM))
KAFKA_DIR     = $(CACHE)/kafka-$(KAFKA_VERSION)
# The oldest broker of the versions scenario (integration/kafka/old/pom.xml:
# Kafka 3.x, the broker alone), for TestRelayAcrossKafkaVersions ...
KAFKA_OLD_POM     = integration/kafka/old/pom.xml
KAFKA_OLD_VERSION = $(shell sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' $(KAFKA_OLD_POM))
KAFKA_OLD_DIR     = $(CACHE)/kafka-$(KAFKA_OLD_VERSION)
# ... and its newest broker (integration/kafka/newest/pom.xml, the broker
# alone: MirrorMaker 2 runs from $(KAFKA_POM)'s jars).
KAFKA_NEWEST_POM     = integration/kafka/newest/pom.xml
KAFKA_NEWEST_VERSION = $(shell sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' $(KAFKA_NEWEST_POM))
KAFKA_NEWEST_DIR     = $(CACHE)/kafka-$(KAFKA_NEWEST_VERSION)
# Kafka's performance tools for make bench, at the same version.
KAFKA_TOOLS_POM = integration/benchtools/pom.xml
KAFKA_TOOLS_DIR = $(CACHE)/kafka-tools-$(KAFKA_VERSION)
# Maven's local repository for kafka-jars; empty: Maven's own (~/.m2/repository).
MAVEN_REPO   ?=
VERSION     ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS     := -X github.com/kswitch/kswitch/internal/version.Version=$(VERSION)

.PHONY: all build test unit example deploy image lint vet staticcheck fmt-check tools bench demo integration etcd-bin kafka-jars kafka-tools clean

all: build

## build: the kswitch binary into bin/kswitch
build:
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/kswitch ./cmd/kswitch

## test: lint, then every package's tests with the race detector, then the embedding example
test: lint unit example deploy

# Most tests wait on the protocol's clocks (session TTLs, probe and
# failure windows), not on the CPU, and call t.Parallel: two per idle
# core run at once (four on an idle 2-core machine; with six, another
# package's tests beside them starved the test producers: a sync
# producer wrote 273 records in 20 s). Cores other work
# already holds do not count (their share of /proc/stat's idle time over a
# second, measured as the tests start), down to one at a time on a machine
# that is busy anyway: with two at once on 2 cores held by busy loops, the
# tests' probes and sessions timed out for want of CPU, not because of
# what they test. Set TEST_PARALLEL to choose. Tests that count goroutines or memory, or
# measure delivery gaps and deadlines against load, do not call
# t.Parallel and run alone first. The agent package takes about 4 minutes
# with -race on an idle machine, up to 10 on a loaded one: go test's
# default 10-minute timeout is too close.
TEST_PARALLEL ?= $(shell { head -1 /proc/stat; sleep 1; head -1 /proc/stat; } 2>/dev/null | \
	awk -v n=$$(nproc 2>/dev/null || echo 2) 'NR == 1 { for (i = 2; i <= NF; i++) t1 += $$i; i1 = $$5 + $$6 } \
	NR == 2 { for (i = 2; i <= NF; i++) t2 += $$i; i2 = $$5 + $$6 } \
	END { p = 1; if (t2 > t1) p = int(2 * n * (i2 - i1) / (t2 - t1) + 0.5); if (p < 1) p = 1; if (p > 2 * n) p = 2 * n; print p }')
unit: $(PROMTOOL)
	KSWITCH_TEST_SCREENSHOTS=$(CURDIR)/$(BIN)/screenshots KSWITCH_PROMTOOL=$(PROMTOOL) $(GO) test -race -count=1 -parallel $(TEST_PARALLEL) -timeout 30m ./...

## deploy: deploy/kubernetes's manifests decoded strictly into the Kubernetes API types and checked against the agent's configuration, and the container image built, loaded back and run against the StatefulSet (modules of their own)
deploy:
	cd deploy/kubernetes && $(GO) vet ./... && $(GO) test -count=1 ./...
	cd deploy/image && $(GO) vet ./... && $(GO) test -count=1 ./...

## image: the agent's container image as a tarball, bin/kswitch-image.tar, built without a container daemon (deploy/image); load it with docker load -i or push it with crane push
image:
	CGO_ENABLED=0 GOOS=linux $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/kswitch-linux ./cmd/kswitch
	cd deploy/image && SOURCE_DATE_EPOCH=$$(git log -1 --format=%ct 2>/dev/null || echo 0) $(GO) run . -binary $(CURDIR)/$(BIN)/kswitch-linux -version $(VERSION) -tag kswitch:$(VERSION) -o $(CURDIR)/$(BIN)/kswitch-image.tar

## example: build, vet and run examples/embed, a module of its own that routes records through a fleet.Member with the public API
example:
	cd examples/embed && $(GO) vet ./... && $(GO) run -race . -records 200

## lint: go vet, staticcheck, gofmt
lint: vet staticcheck fmt-check

vet:
	$(GO) vet ./...

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...

fmt-check:
	@out=$$(gofmt -l $$(find . -name '*.go' -not -path './bin/*')); \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

tools: $(STATICCHECK) $(PROMTOOL)

$(PROMTOOL):
	GOBIN=$(dir $(PROMTOOL)) $(GO) install github.com/prometheus/prometheus/cmd/promtool@$(PROMTOOL_VERSION)

$(STATICCHECK):
	GOBIN=$(TOOLS) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

## bench: benchmarks, each against a baseline measured in the same run: the in-process ones, then the real stack's (integration/bench*_test.go), which rewrite docs/BENCHMARKS.md, docs/benchmarks.json and docs/scale.svg (about 25 minutes here: BenchmarkEtcdDatabaseUnderCompaction takes 10 of them, KSWITCH_BENCH_FLAT sets how long)
bench: build etcd-bin kafka-jars kafka-tools
	@command -v kcat >/dev/null || { echo "kcat is missing: apt-get install kcat"; exit 1; }
	@set -o pipefail; start=$$(date +%s); echo "load average: $$(cut -d' ' -f1-3 /proc/loadavg)"; \
	$(GO) build -o $(BIN)/relayloop ./integration/tools/relayloop && \
	KSWITCH_BENCH_OUT=$(CURDIR)/docs $(GO) test -run '^$$' -bench . -benchtime 1x -count 1 -timeout 60m ./... | tee $(BIN)/bench.txt | grep --line-buffered -E '^(Benchmark|scale|etcd flat|etcd ceiling|pause apply|planned switch|dynamic source|relay of|exactly-once cost|etcd outage|chain switches|ok|FAIL|PASS)' && \
	KSWITCH_TEST_BIN=$(CURDIR)/$(BIN)/kswitch KSWITCH_TEST_ETCD_DIR=$(ETCD_DIR) KSWITCH_TEST_KAFKA_DIR=$(KAFKA_DIR) \
	KSWITCH_TEST_LOG_DIR=$(CURDIR)/integration/logs KSWITCH_BENCH_RELAYLOOP=$(CURDIR)/$(BIN)/relayloop \
	KSWITCH_BENCH_TOOLS=$(KAFKA_TOOLS_DIR)/libs KSWITCH_BENCH_GO=$(CURDIR)/$(BIN)/bench.txt KSWITCH_BENCH_OUT=$(CURDIR)/docs KSWITCH_BENCH_MAKE_STARTED=$$start \
	$(GO) test -count=1 -tags 'integration bench' -timeout 30m -v -run '^TestBenchmarksOnRealStack$$' ./integration/ \
	  | tee $(BIN)/bench-real.txt | grep --line-buffered -E 'bench phase|target |relay |Performance|cost trial|failover trial|rebalance |real-stack|^(--- |ok|FAIL|PASS)' && \
	echo "make bench: $$(( $$(date +%s) - start )) s; docs/BENCHMARKS.md and docs/benchmarks.json rewritten"

## demo: an embedded fleet: election, a leader crash, a clean hand-over
demo: build
	$(BIN)/kswitch demo

## integration: real etcd, Kafka (KRaft), MirrorMaker 2, kcat and kswitch processes, killed and restarted (build tag integration)
integration: build etcd-bin kafka-jars
	@command -v kcat >/dev/null || { echo "kcat is missing: apt-get install kcat"; exit 1; }
	KSWITCH_TEST_BIN=$(CURDIR)/$(BIN)/kswitch KSWITCH_TEST_ETCD_DIR=$(ETCD_DIR) KSWITCH_TEST_KAFKA_DIR=$(KAFKA_DIR) \
	KSWITCH_TEST_KAFKA_DIR_OLD=$(KAFKA_OLD_DIR) KSWITCH_TEST_KAFKA_DIR_NEWEST=$(KAFKA_NEWEST_DIR) \
	KSWITCH_TEST_LOG_DIR=$(CURDIR)/integration/logs KSWITCH_TEST_REPORT_DIR=$(CURDIR)/integration/report \
	$(GO) test -race -count=1 -tags integration -timeout 20m -v $(if $(RUN),-run '$(RUN)') ./integration/...

## chaos: 3 kswitch agent processes on an embedded stack (etcd, kfake A, B, C, mirrors both ways, a producer) under a seeded nemesis, checked from outside (build tag chaos; docs/CHAOS.md). CHAOS_SEED replays a timeline; CHAOS_DURATION (default 10m), CHAOS_FAULTS (kinds, comma-separated), CHAOS_MODE (at_least_once or exactly_once)
CHAOS_DURATION ?= 10m
.PHONY: chaos
chaos: build
	$(GO) build -tags chaos -o $(BIN)/chaosstack ./integration/chaos/stack
	CHAOS_BIN=$(CURDIR)/$(BIN)/kswitch CHAOS_STACK=$(CURDIR)/$(BIN)/chaosstack CHAOS_SEED=$(CHAOS_SEED) CHAOS_DURATION=$(CHAOS_DURATION) \
	CHAOS_FAULTS=$(CHAOS_FAULTS) CHAOS_MODE=$(CHAOS_MODE) CHAOS_LOG_DIR=$(CURDIR)/integration/logs/chaos \
	$(GO) test -count=1 -tags chaos -timeout 0 -v -run '^TestChaos$$' ./integration/chaos/

## chaos-ci: the short chaos pass CI runs (docs/CHAOS.md, "In CI"): make chaos for CHAOS_CI_DURATION (1m) with each seed:mode of CHAOS_CI_SEEDS, then one random seed (printed before it runs, its mode drawn from it); fails naming every seed that failed and its replay command
CHAOS_CI_SEEDS    ?= 11:at_least_once 12:exactly_once
CHAOS_CI_DURATION ?= 1m
.PHONY: chaos-ci
chaos-ci: build
	$(GO) build -tags chaos -o $(BIN)/chaosstack ./integration/chaos/stack
	$(GO) test -c -tags chaos -o $(BIN)/chaos.test ./integration/chaos/
	@random=$$(( (RANDOM << 15 | RANDOM) % 1000000 )); modes=(at_least_once exactly_once); \
	runs="$(CHAOS_CI_SEEDS) $$random:$${modes[$$(( random % 2 ))]}"; \
	echo "chaos-ci: $(CHAOS_CI_DURATION) each, seed:mode $$runs (the last one random)"; \
	failed=(); \
	for run in $$runs; do seed=$${run%%:*}; mode=$${run#*:}; \
	  echo "== chaos-ci: seed $$seed, $$mode, $(CHAOS_CI_DURATION)"; \
	  CHAOS_BIN=$(CURDIR)/$(BIN)/kswitch CHAOS_STACK=$(CURDIR)/$(BIN)/chaosstack CHAOS_SEED=$$seed CHAOS_DURATION=$(CHAOS_CI_DURATION) \
	  CHAOS_MODE=$$mode CHAOS_LOG_DIR=$(CURDIR)/integration/logs/chaos $(BIN)/chaos.test -test.count=1 -test.timeout=10m -test.v -test.run '^TestChaos$$' \
	    | tee $(BIN)/chaos-ci.out; \
	  if [ $${PIPESTATUS[0]} -ne 0 ] || ! grep -q '^--- PASS: TestChaos' $(BIN)/chaos-ci.out; then failed+=("$$seed:$$mode"); fi; \
	done; \
	if [ $${#failed[@]} -gt 0 ]; then \
	  for f in "$${failed[@]}"; do echo "chaos-ci: seed $${f%%:*} FAILED ($${f#*:}); replay: make chaos CHAOS_SEED=$${f%%:*} CHAOS_DURATION=$(CHAOS_CI_DURATION) CHAOS_MODE=$${f#*:}"; done; \
	  exit 1; fi; \
	echo "chaos-ci: every seed passed: $$runs"

## etcd-bin: the pinned etcd server and etcdctl (integration/tools/etcd/go.mod), built into $(CACHE)
etcd-bin:
	@if [ -x $(ETCD_DIR)/etcd ] && [ -x $(ETCD_DIR)/etcdctl ]; then echo "etcd $(ETCD_VERSION) cached in $(ETCD_DIR)"; else \
	  echo "building etcd $(ETCD_VERSION) into $(ETCD_DIR) (about 2 minutes, once)"; start=$$(date +%s); \
	  cd integration/tools/etcd && $(GO) build -o $(ETCD_DIR)/etcd go.etcd.io/etcd/server/v3 && \
	  $(GO) build -o $(ETCD_DIR)/etcdctl go.etcd.io/etcd/etcdctl/v3 && \
	  echo "etcd and etcdctl built in $$(( $$(date +%s) - start )) s"; fi

## kafka-jars: the Kafka broker and MirrorMaker 2 jars of $(KAFKA_POM) into $(KAFKA_DIR)/libs, and the versions scenario's brokers of $(KAFKA_OLD_POM) and $(KAFKA_NEWEST_POM) into $(KAFKA_OLD_DIR)/libs and $(KAFKA_NEWEST_DIR)/libs, copied by Maven (once each; again when its pom changes)
kafka-jars:
	$(call fetch-kafka-jars,$(KAFKA_POM),$(KAFKA_VERSION),$(KAFKA_DIR))
	$(call fetch-kafka-jars,$(KAFKA_OLD_POM),$(KAFKA_OLD_VERSION),$(KAFKA_OLD_DIR))
	$(call fetch-kafka-jars,$(KAFKA_NEWEST_POM),$(KAFKA_NEWEST_VERSION),$(KAFKA_NEWEST_DIR))

# fetch-kafka-jars POM,VERSION,DIR: the runtime classpath of POM into DIR/libs, unless DIR holds it for this very pom.
define fetch-kafka-jars
	@if [ -f $(3)/libs/.complete ] && cmp -s $(1) $(3)/pom.xml; then echo "Kafka $(2) jars cached in $(3)/libs"; else \
	  command -v mvn >/dev/null || { echo "mvn is missing: Maven 3 fetches the Kafka jars"; exit 1; }; \
	  echo "fetching Kafka $(2) jars into $(3)/libs (about 30 s, once)"; \
	  rm -rf $(3) && mkdir -p $(3) && start=$$(date +%s) && \
	  mvn -B -q -f $(1) $(if $(MAVEN_REPO),-Dmaven.repo.local=$(MAVEN_REPO)) -Dkafka.libs=$(3)/libs package && \
	  cp $(1) $(3)/pom.xml && touch $(3)/libs/.complete && \
	  echo "$$(ls $(3)/libs | wc -l) jars in $$(( $$(date +%s) - start )) s"; fi
endef

## kafka-tools: Kafka's ProducerPerformance and ConsumerPerformance (kafka-tools, integration/benchtools/pom.xml, at $(KAFKA_POM)'s version) into $(KAFKA_TOOLS_DIR)/libs, for make bench (once)
kafka-tools:
	@if [ -f $(KAFKA_TOOLS_DIR)/libs/.complete ] && cmp -s $(KAFKA_TOOLS_POM) $(KAFKA_TOOLS_DIR)/pom.xml; then echo "Kafka $(KAFKA_VERSION) tools cached in $(KAFKA_TOOLS_DIR)/libs"; else \
	  command -v mvn >/dev/null || { echo "mvn is missing: Maven 3 fetches Kafka's tools"; exit 1; }; \
	  echo "fetching Kafka $(KAFKA_VERSION) tools into $(KAFKA_TOOLS_DIR)/libs (once)"; \
	  rm -rf $(KAFKA_TOOLS_DIR) && mkdir -p $(KAFKA_TOOLS_DIR) && \
	  mvn -B -q -f $(KAFKA_TOOLS_POM) -Dkafka.version=$(KAFKA_VERSION) -Dkafka.libs=$(KAFKA_TOOLS_DIR)/libs package && \
	  cp $(KAFKA_TOOLS_POM) $(KAFKA_TOOLS_DIR)/pom.xml && touch $(KAFKA_TOOLS_DIR)/libs/.complete; fi

clean:
	rm -rf $(BIN)
