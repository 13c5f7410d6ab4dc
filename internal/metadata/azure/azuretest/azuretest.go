// Package azuretest serves a local fake of the two Azure APIs the azure metadata provider reads, in
// their documented, recorded shapes: the Instance Metadata Service (/metadata/instance and the managed
// identity's /metadata/identity/oauth2/token; the header "Metadata: true" and an api-version required,
// 400 with IMDS's error JSON otherwise) over plain HTTP, and Azure Resource Manager's VM and network
// interface listings of a resource group (a Bearer token and an api-version required, nextLink
// pagination, ARM error JSON) over TLS, as ARM is. For tests only; both listen on loopback.
package azuretest

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Names of the fake's subscription.
const (
	Subscription  = "00000000-1111-2222-3333-444444444444"
	ResourceGroup = "berth-rg"
	Location      = "westeurope"
	// InitSecretHash is the hex init-secret hash the fake's cp-0 carries.
	InitSecretHash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	// Endpoint is the control-plane endpoint cp-0 carries.
	Endpoint = "10.0.0.100:6443"
)

// VM is one virtual machine as the fake knows it, with one network interface.
type VM struct {
	Name, ProvisioningState string
	IPs                     []string // private IPv4 addresses of its NIC; the first is the primary configuration's
	Tags                    map[string]string
}

// Fake holds the fake's state. Change it with Update while the fake serves.
type Fake struct {
	// Self is the name of the calling VM.
	Self string
	// VMs are the resource group's VMs.
	VMs []VM
	// IMDSStatus, when not 0, fails every IMDS request with it.
	IMDSStatus int
	// ARMStatus, when not 0, fails every ARM request with it (429 as TooManyRequests).
	ARMStatus int
	// RejectTokens makes ARM answer every token with 401 ExpiredAuthenticationToken.
	RejectTokens bool
	// PageSize is how many items one ARM list page holds.
	PageSize int
	// TokenRequests counts managed identity token requests; VMListRequests and NICListRequests count
	// ARM list pages served.
	TokenRequests, VMListRequests, NICListRequests int
	// ARMRequests counts every ARM request, refused ones included.
	ARMRequests int

	// IMDSURL is the instance metadata service's base URL (http).
	IMDSURL string
	// ARMURL is Azure Resource Manager's base URL (https, with the server's own certificate).
	ARMURL string
	// Client trusts the ARM server's certificate.
	Client *http.Client

	mu     sync.Mutex
	tokens map[string]bool
}

// New serves a fake resource group with one cluster c1 (control planes cp-0 and cp-1, worker w-0, a
// failed w-1, a role-less w-2) and another cluster's other-0; the caller is cp-0, which carries the
// control-plane endpoint and init-secret hash tags. Both servers close when the test ends.
func New(t testing.TB) *Fake {
	tags := func(cluster, role string) map[string]string {
		m := map[string]string{"berth-cluster": cluster}
		if role != "" {
			m["berth-role"] = role
		}
		return m
	}
	cp0 := tags("c1", "control-plane")
	cp0["berth-control-plane-endpoint"] = Endpoint
	cp0["berth-init-secret-hash"] = InitSecretHash
	f := &Fake{
		Self: "cp-0", PageSize: 2, tokens: map[string]bool{},
		VMs: []VM{
			{"cp-0", "Succeeded", []string{"10.0.0.4", "10.0.0.14"}, cp0},
			{"cp-1", "Succeeded", []string{"10.0.0.5"}, tags("c1", "control-plane")},
			{"w-0", "Succeeded", []string{"10.0.0.6"}, tags("c1", "worker")},
			{"w-1", "Failed", []string{"10.0.0.7"}, tags("c1", "worker")},
			{"w-2", "Succeeded", []string{"10.0.0.8"}, tags("c1", "")},
			{"other-0", "Succeeded", []string{"10.0.1.4"}, tags("c2", "worker")},
		},
	}
	im := httptest.NewServer(http.HandlerFunc(f.serveIMDS))
	t.Cleanup(im.Close)
	arm := httptest.NewTLSServer(http.HandlerFunc(f.serveARM))
	t.Cleanup(arm.Close)
	f.IMDSURL, f.ARMURL, f.Client = im.URL, arm.URL, arm.Client()
	return f
}

// Update changes the fake's state under its lock.
func (f *Fake) Update(fn func(*Fake)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

// Read reads the fake's state under its lock.
func (f *Fake) Read(fn func(*Fake)) { f.Update(fn) }

// ExpireTokens makes ARM refuse every token handed out so far (401 ExpiredAuthenticationToken), as
// after their expiry. Call it inside Update.
func (f *Fake) ExpireTokens() { f.tokens = map[string]bool{} }

func (f *Fake) find(name string) (VM, bool) {
	for _, vm := range f.VMs {
		if vm.Name == name {
			return vm, true
		}
	}
	return VM{}, false
}

func imdsError(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (f *Fake) serveIMDS(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Metadata") != "true" {
		imdsError(w, http.StatusBadRequest, map[string]string{"error": "Bad request. Required metadata header not specified"})
		return
	}
	if r.Header.Get("X-Forwarded-For") != "" {
		imdsError(w, http.StatusBadRequest, map[string]string{"error": "Bad request. Request contains X-Forwarded-For header"})
		return
	}
	if r.URL.Query().Get("api-version") == "" {
		imdsError(w, http.StatusBadRequest, map[string]any{
			"error":           "Bad request. api-version was not specified in the request. For more information refer to aka.ms/azureimds",
			"newest-versions": []string{"2023-07-01", "2021-02-01", "2020-12-01"},
		})
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.IMDSStatus != 0 {
		imdsError(w, f.IMDSStatus, map[string]string{"error": http.StatusText(f.IMDSStatus)})
		return
	}
	self, _ := f.find(f.Self)
	switch r.URL.Path {
	case "/metadata/instance":
		var tagsList []map[string]string
		var tags []string
		for _, k := range slices.Sorted(maps.Keys(self.Tags)) {
			tagsList = append(tagsList, map[string]string{"name": k, "value": self.Tags[k]})
			tags = append(tags, k+":"+self.Tags[k])
		}
		var addrs []map[string]string
		for _, ip := range self.IPs {
			addrs = append(addrs, map[string]string{"privateIpAddress": ip, "publicIpAddress": ""})
		}
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		_ = json.NewEncoder(w).Encode(map[string]any{
			"compute": map[string]any{
				"azEnvironment": "AzurePublicCloud", "location": Location, "name": self.Name, "osType": "Linux",
				"resourceGroupName": ResourceGroup, "resourceId": vmID(self.Name), "subscriptionId": Subscription,
				"tags": strings.Join(tags, ";"), "tagsList": tagsList, "vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
				"vmSize": "Standard_D2s_v5", "zone": "1",
				"securityProfile": map[string]string{"secureBootEnabled": "true", "virtualTpmEnabled": "true"},
			},
			"network": map[string]any{"interface": []any{map[string]any{
				"ipv4":       map[string]any{"ipAddress": addrs, "subnet": []any{map[string]string{"address": "10.0.0.0", "prefix": "24"}}},
				"ipv6":       map[string]any{"ipAddress": []any{}},
				"macAddress": "000D3AF806EC",
			}}},
		})
	case "/metadata/identity/oauth2/token":
		resource := r.URL.Query().Get("resource")
		if resource == "" {
			imdsError(w, http.StatusBadRequest, map[string]string{"error": "invalid_request", "error_description": "Required audience parameter not specified"})
			return
		}
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		tok := "eyJ0eXAi.fake-" + hex.EncodeToString(b)
		f.tokens[tok] = true
		f.TokenRequests++
		now := time.Now()
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		_ = json.NewEncoder(w).Encode(map[string]string{
			"access_token": tok, "client_id": "7dd7250b-0f1e-4c8a-8c3e-2b1e5c4f0a11", "refresh_token": "",
			"expires_in": "86399", "expires_on": strconv.FormatInt(now.Add(24*time.Hour).Unix(), 10),
			"ext_expires_in": "86399", "not_before": strconv.FormatInt(now.Unix(), 10),
			"resource": resource, "token_type": "Bearer",
		})
	default:
		imdsError(w, http.StatusNotFound, map[string]string{"error": "Not found"})
	}
}

func vmID(name string) string {
	return "/subscriptions/" + Subscription + "/resourceGroups/" + ResourceGroup + "/providers/Microsoft.Compute/virtualMachines/" + name
}

func armError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("x-ms-failure-cause", "gateway")
	if status == http.StatusTooManyRequests {
		w.Header().Set("Retry-After", "1")
	}
	if status == http.StatusUnauthorized {
		w.Header().Set("WWW-Authenticate", `Bearer authorization_uri="https://login.microsoftonline.com/common", error="invalid_token", error_description="The access token is expired."`)
	}
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]string{"code": code, "message": msg}})
}

func (f *Fake) serveARM(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ARMRequests++
	auth := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	if f.RejectTokens || !f.tokens[auth] {
		armError(w, http.StatusUnauthorized, "ExpiredAuthenticationToken",
			"The access token expiry UTC time '11/24/2025 10:00:00 PM' is earlier than current UTC time '11/24/2025 11:00:00 PM'.")
		return
	}
	if r.URL.Query().Get("api-version") == "" {
		armError(w, http.StatusBadRequest, "MissingApiVersionParameter", "The api-version query parameter (?api-version=) is required for all requests.")
		return
	}
	switch f.ARMStatus {
	case 0:
	case http.StatusTooManyRequests:
		armError(w, f.ARMStatus, "TooManyRequests", "The request is being throttled as the limit has been reached for operation type - Read_ObservationWindow_00:05:00.")
		return
	default:
		armError(w, f.ARMStatus, "InternalServerError", http.StatusText(f.ARMStatus))
		return
	}
	prefix := "/subscriptions/" + Subscription + "/resourceGroups/" + ResourceGroup + "/providers/"
	var items []any
	switch r.URL.Path {
	case prefix + "Microsoft.Compute/virtualMachines":
		f.VMListRequests++
		for _, vm := range f.VMs {
			items = append(items, apiVM(vm))
		}
	case prefix + "Microsoft.Network/networkInterfaces":
		f.NICListRequests++
		for _, vm := range f.VMs {
			items = append(items, apiNIC(vm))
		}
	default:
		armError(w, http.StatusNotFound, "ResourceNotFound", "The resource was not found.")
		return
	}
	start := 0
	if tok := r.URL.Query().Get("$skiptoken"); tok != "" {
		var err error
		if start, err = strconv.Atoi(tok); err != nil || start > len(items) {
			armError(w, http.StatusBadRequest, "InvalidSkipToken", "The skip token is not valid.")
			return
		}
	}
	end := min(start+f.PageSize, len(items))
	resp := map[string]any{"value": items[start:end]}
	if end < len(items) {
		q := r.URL.Query()
		q.Set("$skiptoken", strconv.Itoa(end))
		resp["nextLink"] = "https://" + r.Host + r.URL.Path + "?" + q.Encode()
	}
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	_ = json.NewEncoder(w).Encode(resp)
}

func apiVM(vm VM) map[string]any {
	return map[string]any{
		"name": vm.Name, "id": vmID(vm.Name), "type": "Microsoft.Compute/virtualMachines", "location": Location,
		"tags": vm.Tags, "zones": []string{"1"},
		"properties": map[string]any{
			"vmId":              "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
			"hardwareProfile":   map[string]string{"vmSize": "Standard_D2s_v5"},
			"provisioningState": vm.ProvisioningState,
			"securityProfile": map[string]any{
				"uefiSettings": map[string]bool{"secureBootEnabled": true, "vTpmEnabled": true}, "securityType": "TrustedLaunch",
			},
			"networkProfile": map[string]any{"networkInterfaces": []any{map[string]any{
				"id":         nicID(vm.Name),
				"properties": map[string]bool{"primary": true},
			}}},
		},
	}
}

func nicID(vm string) string {
	return "/subscriptions/" + Subscription + "/resourceGroups/" + ResourceGroup + "/providers/Microsoft.Network/networkInterfaces/" + vm + "-nic"
}

func apiNIC(vm VM) map[string]any {
	var cfgs []any
	for i, ip := range vm.IPs {
		cfgs = append(cfgs, map[string]any{
			"name": fmt.Sprintf("ipconfig%d", i+1), "id": nicID(vm.Name) + fmt.Sprintf("/ipConfigurations/ipconfig%d", i+1),
			"properties": map[string]any{
				"provisioningState": "Succeeded", "privateIPAddress": ip, "privateIPAllocationMethod": "Dynamic",
				"privateIPAddressVersion": "IPv4", "primary": i == 0,
				"subnet": map[string]string{"id": "/subscriptions/" + Subscription + "/resourceGroups/" + ResourceGroup + "/providers/Microsoft.Network/virtualNetworks/berth-vnet/subnets/nodes"},
			},
		})
	}
	return map[string]any{
		"name": vm.Name + "-nic", "id": nicID(vm.Name), "type": "Microsoft.Network/networkInterfaces", "location": Location,
		"properties": map[string]any{
			"provisioningState": "Succeeded", "ipConfigurations": cfgs, "primary": true, "macAddress": "00-0D-3A-F8-06-EC",
			// ARM may spell a resource ID in another case than its creator did.
			"virtualMachine": map[string]string{"id": strings.ToUpper(vmID(vm.Name)[:14]) + vmID(vm.Name)[14:]},
		},
	}
}
