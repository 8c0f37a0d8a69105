// Package archtest holds no code: its test checks the module's import
// layers (docs/ARCHITECTURE.md, "Layers"), that routing does not depend on
// the agent, and that the kswitch binary links no test infrastructure.
package archtest
