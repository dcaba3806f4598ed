//go:build tools

// Package tools records the etcd server built by scripts/test-tools so that
// `go mod tidy` keeps its dependencies in go.mod/go.sum.
package tools

import _ "go.etcd.io/etcd/server/v3"
