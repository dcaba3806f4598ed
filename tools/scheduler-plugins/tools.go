//go:build tools

// Package tools records the scheduler-plugins kube-scheduler (Coscheduling and the
// other out-of-tree plugins) built by scripts/test-tools, so that `go mod tidy` keeps
// its dependencies in go.mod/go.sum.
package tools

import (
	_ "sigs.k8s.io/scheduler-plugins/cmd/scheduler"
)
