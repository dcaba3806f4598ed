"""Generated from k8s.io/kubelet@v0.34.10 pkg/apis/podresources/v1/api.proto
by scripts/gen-podresources. Do not edit."""
