package mini

import (
	"fmt"
	"net/netip"
)

// flannelManifest is the pod network the bootstrapper installs after kubeadm init (its components
// directory): flanneld in host-gw mode, which works because all nodes share one L2 segment (the
// switch). It leases each node the podCIDR the controller-manager allocated and routes the other
// nodes' pod subnets via their node addresses. It talks to the API server at apiServer directly,
// so it does not depend on kube-proxy, and it installs no firewall rules (no masquerading: pods
// never leave the cluster).
func flannelManifest(podCIDR netip.Prefix, apiServer netip.AddrPort) []byte {
	return []byte(fmt.Sprintf(`# Written by berth mini: flannel %[1]s in host-gw mode.
apiVersion: v1
kind: Namespace
metadata:
  name: kube-flannel
  labels:
    pod-security.kubernetes.io/enforce: privileged
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: flannel
  namespace: kube-flannel
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: flannel
rules:
- apiGroups: [""]
  resources: [pods]
  verbs: [get]
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [nodes/status]
  verbs: [patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: flannel
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: flannel
subjects:
- kind: ServiceAccount
  name: flannel
  namespace: kube-flannel
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: kube-flannel-cfg
  namespace: kube-flannel
data:
  net-conf.json: |
    {"Network": "%[2]s", "EnableIPv4": true, "Backend": {"Type": "host-gw"}}
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: kube-flannel-ds
  namespace: kube-flannel
  labels:
    app: flannel
spec:
  selector:
    matchLabels:
      app: flannel
  template:
    metadata:
      labels:
        app: flannel
    spec:
      hostNetwork: true
      priorityClassName: system-node-critical
      serviceAccountName: flannel
      tolerations:
      - operator: Exists
      containers:
      - name: kube-flannel
        image: %[3]s
        imagePullPolicy: Never
        command: [/opt/bin/flanneld]
        args:
        - --kube-subnet-mgr
        - --iface=eth0
        - --ip-masq=false
        - --iptables-forward-rules=false
        - --net-config-path=/etc/kube-flannel/net-conf.json
        - --subnet-file=/run/flannel/subnet.env
        env:
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        - name: POD_NAME
          valueFrom: {fieldRef: {fieldPath: metadata.name}}
        - name: POD_NAMESPACE
          valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
        - name: KUBERNETES_SERVICE_HOST
          value: "%[4]s"
        - name: KUBERNETES_SERVICE_PORT
          value: "%[5]d"
        resources:
          requests: {cpu: 10m, memory: 32Mi}
        securityContext:
          privileged: false
          capabilities:
            add: [NET_ADMIN, NET_RAW]
        volumeMounts:
        - {name: run, mountPath: /run/flannel}
        - {name: cfg, mountPath: /etc/kube-flannel/}
      volumes:
      - name: run
        hostPath: {path: /run/flannel, type: DirectoryOrCreate}
      - name: cfg
        configMap: {name: kube-flannel-cfg}
`, "v0.28.4", podCIDR.Masked(), ImageFlannel, apiServer.Addr(), apiServer.Port()))
}
