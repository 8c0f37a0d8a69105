// Package archtest holds no code: its test checks the module's import
// layers (docs/ARCHITECTURE.md, "Layers"), that routing does not depend on
// the agent, that the kswitch binary links no test infrastructure, that no
// package of the record path builds sarama's Consumer or AsyncProducer,
// and that files and functions stay short enough to read at once.
package archtest
