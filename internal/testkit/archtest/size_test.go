package archtest

import (
	"bytes"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Bounds on what a newcomer reads at once: a file has one job a reader
// can hold, a function one screenful of steps.
const (
	maxFileLines = 600
	maxFuncLines = 80
)

// longFuncs are the functions allowed over maxFuncLines, with why. A table
// is read a row at a time, and the demo's story is read as a story.
var longFuncs = map[string]string{
	"agent.newMetrics":       "the agent's metric registration table",
	"routing.newMetrics":     "the routing sink's metric registration table",
	"coordinator.NewMetrics": "the leader's metric registration table",
	"demo.(*demo).story":     "the demo's story, told in order",
}

// TestFilesAndFunctionsStayShort: no non-test Go file of the module (of
// any build tag) is
// over maxFileLines lines, and no function over maxFuncLines (its doc
// comment not counted) but those in longFuncs.
func TestFilesAndFunctionsStayShort(t *testing.T) {
	fset := token.NewFileSet()
	seen := map[string]bool{}
	// The integration suite, the chaos harness and the benchmarks' own
	// files are read too.
	for _, p := range list(t, "-tags=integration,chaos,bench", "./...") {
		for _, name := range p.GoFiles {
			path := filepath.Join(p.Dir, name)
			src, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			rel := strings.TrimPrefix(p.ImportPath, module) + "/" + name
			if n := bytes.Count(src, []byte("\n")); n > maxFileLines {
				t.Errorf("%s has %d lines (at most %d): split it along its jobs, one file each", rel, n, maxFileLines)
			}
			f, err := parser.ParseFile(fset, path, src, 0)
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range f.Decls {
				fd, ok := d.(*ast.FuncDecl)
				if !ok {
					continue
				}
				id := f.Name.Name + "." + funcName(fd)
				n := fset.Position(fd.End()).Line - fset.Position(fd.Pos()).Line + 1
				if _, allowed := longFuncs[id]; allowed {
					seen[id] = true
				} else if n > maxFuncLines {
					t.Errorf("%s: %s has %d lines (at most %d): name its steps as functions of their own", rel, id, n, maxFuncLines)
				}
			}
		}
	}
	for id := range longFuncs {
		if !seen[id] {
			t.Errorf("longFuncs allows %s, which no longer exists: remove it", id)
		}
	}
}

// funcName is fd's name as a reader writes it: F, or (*T).M and T.M for
// methods.
func funcName(fd *ast.FuncDecl) string {
	if fd.Recv == nil || len(fd.Recv.List) == 0 {
		return fd.Name.Name
	}
	typ := fd.Recv.List[0].Type
	star := ""
	if s, ok := typ.(*ast.StarExpr); ok {
		star, typ = "*", s.X
	}
	if ix, ok := typ.(*ast.IndexExpr); ok {
		typ = ix.X
	}
	id, _ := typ.(*ast.Ident)
	if id == nil {
		return fd.Name.Name
	}
	if star != "" {
		return "(*" + id.Name + ")." + fd.Name.Name
	}
	return id.Name + "." + fd.Name.Name
}
