//go:build tools

// Package tools pins flanneld so that go mod tidy keeps its dependencies in this module's graph.
package tools

import _ "github.com/flannel-io/flannel"
