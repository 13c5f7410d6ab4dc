// Package berth is the root of Berth's module. It holds no code of its own, only the test that keeps
// the import rules between the tree's parts (imports_test.go): the bootstrapper and the joinservice
// stand side by side and share their contracts through internal/, never through each other.
package berth
