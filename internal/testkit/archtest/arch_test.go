package archtest

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

const module = "github.com/kswitch/kswitch/"

// layers ranks every package of the module (but the integration suite's):
// a package imports only packages of lower layers. A new package gets a
// line here; its layer says where it stands.
var layers = map[string]int{
	// 0: leaves, no import of the module.
	"record": 0, "keys": 0, "election": 0, "internal/etcdwatch": 0, "internal/freeport": 0,
	"internal/logx": 0, "internal/refused": 0, "internal/version": 0, "internal/testkit/wait": 0, "internal/testkit/archtest": 0,
	"internal/notify": 0,
	// deploy has tests only (the deployment files against the code).
	"deploy": 0,
	// 1: the configuration; the embedded stack.
	"config": 1, "devstack": 1,
	// 2: clients of Kafka and etcd; signals; the test wrappers.
	"internal/kafka": 2, "internal/etcdclient": 2, "signals": 2, "internal/testkit/testenv": 2,
	// 3: the fenced offset store; the tests' hooks.
	"offsets": 3, "internal/testhooks": 3,
	// 4: translation between clusters; the routing sink; the schema of
	// the fleet's etcd values.
	"translate": 4, "routing": 4, "state": 4,
	// 5: the leader's work; the dynamic configuration; the demo's mirror.
	"coordinator": 5, "internal/dynconfig": 5, "devstack/mirror": 5,
	// 6: the fleet seen from outside: its read model and status page.
	"fleetview": 6,
	// 7: one agent.
	"agent": 7,
	// 8: the façade: an agent with the routing sink, the operator.
	"fleet": 8,
	// 9: the demo; 10: the commands; 11: the binary.
	"cmd/kswitch/internal/demo": 9, "cmd/kswitch/internal/cli": 10, "cmd/kswitch": 11,
}

type pkg struct {
	ImportPath string
	Dir        string
	GoFiles    []string
	Imports    []string
	Deps       []string
}

// list runs go list -json on patterns.
func list(t *testing.T, patterns ...string) []pkg {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-json"}, patterns...)...)
	cmd.Dir = "../../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list %v: %v", patterns, err)
	}
	var ps []pkg
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p pkg
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	return ps
}

// TestImportsGoDownTheLayers: no package imports one of its own or a
// higher layer (an arrow running back up), and every package has a layer.
func TestImportsGoDownTheLayers(t *testing.T) {
	for _, p := range list(t, "./...") {
		name := strings.TrimPrefix(p.ImportPath, module)
		if strings.HasPrefix(name, "integration") {
			continue
		}
		l, ok := layers[name]
		if !ok {
			t.Errorf("%s has no layer: add it to layers in internal/testkit/archtest/arch_test.go and to docs/ARCHITECTURE.md", name)
			continue
		}
		for _, imp := range p.Imports {
			dep, ok := strings.CutPrefix(imp, module)
			if !ok {
				continue
			}
			if dl, ok := layers[dep]; ok && dl >= l {
				t.Errorf("%s (layer %d) imports %s (layer %d): an import must go to a lower layer", name, l, dep, dl)
			}
		}
	}
}

// TestBinaryLinksNoTestCode: the shipped binary does not link testing,
// goleak or the test wrappers, and the routing sink does not depend on the
// agent's runtime.
func TestBinaryLinksNoTestCode(t *testing.T) {
	for _, tc := range []struct {
		pkg       string
		forbidden []string
	}{
		{"./cmd/kswitch", []string{"testing", "go.uber.org/goleak", module + "internal/testkit/testenv", module + "internal/testkit/wait"}},
		{"./routing", []string{module + "agent"}},
		{"./record", nil}, // checked below: no kswitch import at all
	} {
		ps := list(t, tc.pkg)
		if len(ps) != 1 {
			t.Fatalf("go list %s: %d packages", tc.pkg, len(ps))
		}
		for _, f := range tc.forbidden {
			if slices.Contains(ps[0].Deps, f) {
				t.Errorf("%s depends on %s", tc.pkg, f)
			}
		}
		if tc.pkg == "./record" {
			for _, d := range ps[0].Deps {
				if strings.HasPrefix(d, module) {
					t.Errorf("record depends on %s: it must stay a leaf", d)
				}
			}
		}
	}
}

// highLevelSarama are sarama's constructors of its high-level clients:
// their goroutines and channel hand-offs per record are what the relay
// left (docs/RELAY.md §1).
var highLevelSarama = []string{
	"NewConsumer", "NewConsumerFromClient", "NewConsumerGroup", "NewConsumerGroupFromClient",
	"NewAsyncProducer", "NewAsyncProducerFromClient", "NewSyncProducer", "NewSyncProducerFromClient",
}

// offRecordPath are the packages that may still build sarama's high-level
// clients: the demo's sample producer and reader (docs/ARCHITECTURE.md).
// The integration suite's tools and examples/embed are modules or
// directories of their own, outside ./... here.
var offRecordPath = []string{"cmd/kswitch/internal/demo"}

// TestNoHighLevelSaramaClientOnTheRecordPath: no package of the binary's
// record path builds sarama's Consumer or AsyncProducer (docs/RELAY.md): the
// agent reads through internal/kafka's Fetcher, routing writes through its
// Producer and TxnStream. sarama's protocol types, Broker and Client stay.
func TestNoHighLevelSaramaClientOnTheRecordPath(t *testing.T) {
	found := 0
	for _, p := range list(t, "./...") {
		name := strings.TrimPrefix(p.ImportPath, module)
		if strings.HasPrefix(name, "integration") || slices.Contains(offRecordPath, name) {
			continue
		}
		for _, f := range p.GoFiles {
			path := filepath.Join(p.Dir, f)
			file, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			local := ""
			for _, imp := range file.Imports {
				if v, _ := strconv.Unquote(imp.Path.Value); v == "github.com/IBM/sarama" {
					local = "sarama"
					if imp.Name != nil {
						local = imp.Name.Name
					}
				}
			}
			if local == "" {
				continue
			}
			found++
			ast.Inspect(file, func(n ast.Node) bool {
				sel, ok := n.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				if x, ok := sel.X.(*ast.Ident); ok && x.Name == local && slices.Contains(highLevelSarama, sel.Sel.Name) {
					t.Errorf("%s: %s.%s on the record path (package %s): use internal/kafka's Fetcher, Producer or TxnStream", path, local, sel.Sel.Name, name)
				}
				return true
			})
		}
	}
	if found == 0 {
		t.Fatal("no file of the module imports sarama: the check looked at nothing")
	}
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
