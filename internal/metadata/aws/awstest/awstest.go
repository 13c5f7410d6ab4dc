// Package awstest serves a local fake of the two AWS APIs the aws metadata provider reads, in their
// documented, recorded shapes: the instance metadata service with IMDSv2 only (a session token from
// PUT /latest/api/token with the TTL header, the token header required on every GET, 401 for a missing
// or unknown token; the instance profile's credentials under iam/security-credentials/) and the EC2
// Query API's DescribeInstances (a SigV4-signed form POST, InstanceId.N and Filter.N, NextToken
// pagination, XML responses and errors). For tests only; it listens on loopback.
package awstest

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Names of the fake's account.
const (
	Region = "eu-central-1"
	// InitSecretHash is the hex init-secret hash the fake's control plane i-0cp0 carries.
	InitSecretHash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	// Endpoint is the control-plane endpoint i-0cp0 carries.
	Endpoint = "berth-nlb-0123456789.elb.eu-central-1.amazonaws.com:6443"
	// AccessKeyID is the key the fake accepts in SigV4 signatures; the instance profile hands it out.
	AccessKeyID = "AKIDEXAMPLE"
	// SecretAccessKey belongs to AccessKeyID.
	SecretAccessKey = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
	// RoleName is the instance profile's role.
	RoleName = "berth-node"
)

// Instance is one EC2 instance as the fake knows it.
type Instance struct {
	ID, DNS, State string
	IPs            []string
	Tags           map[string]string
}

// Fake holds the fake's state. Change it with Update while the fake serves.
type Fake struct {
	// Self is the ID of the calling instance.
	Self string
	// Instances are the account's instances.
	Instances []Instance
	// TokenPuts counts IMDSv2 session tokens handed out.
	TokenPuts int
	// RejectAll makes every IMDS GET answer 401, whatever the token.
	RejectAll bool
	// ExpireOnce makes the next IMDS GET answer 401 and forget every token.
	ExpireOnce bool
	// IMDSStatus, when not 0, fails every IMDS GET (with a valid token) with it.
	IMDSStatus int
	// EC2Error, when set, fails DescribeInstances with this code (HTTP 503 for a throttle code, else 400).
	EC2Error string
	// Describes counts DescribeInstances calls that got an answer.
	Describes int
	// LastFilters are the filters of the last DescribeInstances call.
	LastFilters map[string][]string
	// PageSize is how many reservations one DescribeInstances page holds.
	PageSize int

	// IMDSURL is the instance metadata service's base URL.
	IMDSURL string
	// EC2URL is the EC2 API's base URL.
	EC2URL string

	mu     sync.Mutex
	tokens map[string]bool
}

// New serves a fake account with one cluster c1 (control planes i-0cp0 and i-0cp1, worker i-0w0, a
// stopped i-0w1, a role-less i-0w2) and another cluster's i-0o0; the caller is i-0cp0, which carries
// the control-plane endpoint and init-secret hash tags. Both servers close when the test ends.
func New(t testing.TB) *Fake {
	role := func(cluster, role string) map[string]string {
		m := map[string]string{"Name": "node", "berth-cluster": cluster}
		if role != "" {
			m["berth-role"] = role
		}
		return m
	}
	cp0 := role("c1", "control-plane")
	cp0["berth-control-plane-endpoint"] = Endpoint
	cp0["berth-init-secret-hash"] = InitSecretHash
	f := &Fake{
		Self: "i-0cp0", tokens: map[string]bool{}, PageSize: 2,
		Instances: []Instance{
			{"i-0cp0", "ip-10-0-0-2.eu-central-1.compute.internal", "running", []string{"10.0.0.2", "10.0.8.2"}, cp0},
			{"i-0cp1", "ip-10-0-0-3.eu-central-1.compute.internal", "running", []string{"10.0.0.3"}, role("c1", "control-plane")},
			{"i-0w0", "ip-10-0-0-4.eu-central-1.compute.internal", "running", []string{"10.0.0.4"}, role("c1", "worker")},
			{"i-0w1", "ip-10-0-0-5.eu-central-1.compute.internal", "stopped", []string{"10.0.0.5"}, role("c1", "worker")},
			{"i-0w2", "ip-10-0-0-6.eu-central-1.compute.internal", "running", []string{"10.0.0.6"}, role("c1", "")},
			{"i-0o0", "ip-10-0-1-2.eu-central-1.compute.internal", "running", []string{"10.0.1.2"}, role("c2", "worker")},
		},
	}
	im := httptest.NewServer(http.HandlerFunc(f.serveIMDS))
	t.Cleanup(im.Close)
	api := httptest.NewServer(http.HandlerFunc(f.serveEC2))
	t.Cleanup(api.Close)
	f.IMDSURL, f.EC2URL = im.URL, api.URL
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

func (f *Fake) find(id string) (Instance, bool) {
	for _, in := range f.Instances {
		if in.ID == id {
			return in, true
		}
	}
	return Instance{}, false
}

func (f *Fake) serveIMDS(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if r.URL.Path == "/latest/api/token" {
		if r.Method != http.MethodPut {
			http.Error(w, "", http.StatusMethodNotAllowed)
			return
		}
		ttl, err := strconv.Atoi(r.Header.Get("X-Aws-Ec2-Metadata-Token-Ttl-Seconds"))
		if err != nil || ttl < 1 || ttl > 21600 {
			http.Error(w, "", http.StatusBadRequest)
			return
		}
		b := make([]byte, 24)
		_, _ = rand.Read(b)
		tok := hex.EncodeToString(b)
		f.tokens[tok] = true
		f.TokenPuts++
		w.Header().Set("X-Aws-Ec2-Metadata-Token-Ttl-Seconds", strconv.Itoa(ttl))
		_, _ = fmt.Fprint(w, tok)
		return
	}
	if r.Method != http.MethodGet {
		http.Error(w, "", http.StatusMethodNotAllowed)
		return
	}
	if f.ExpireOnce {
		f.ExpireOnce, f.tokens = false, map[string]bool{}
	}
	if f.RejectAll || !f.tokens[r.Header.Get("X-Aws-Ec2-Metadata-Token")] {
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	if f.IMDSStatus != 0 {
		w.WriteHeader(f.IMDSStatus)
		return
	}
	self, _ := f.find(f.Self)
	w.Header().Set("Content-Type", "text/plain")
	switch strings.TrimPrefix(r.URL.Path, "/latest/meta-data/") {
	case "instance-id":
		_, _ = fmt.Fprint(w, self.ID)
	case "local-hostname":
		_, _ = fmt.Fprint(w, self.DNS)
	case "local-ipv4":
		_, _ = fmt.Fprint(w, self.IPs[0])
	case "placement/region":
		_, _ = fmt.Fprint(w, Region)
	case "iam/security-credentials/":
		_, _ = fmt.Fprint(w, RoleName)
	case "iam/security-credentials/" + RoleName:
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{
			"Code": "Success", "LastUpdated": time.Now().UTC().Format(time.RFC3339), "Type": "AWS-HMAC",
			"AccessKeyId": AccessKeyID, "SecretAccessKey": SecretAccessKey, "Token": "IQoJb3JpZ2luX2VjEFAKE",
			"Expiration": time.Now().Add(6 * time.Hour).UTC().Format(time.RFC3339),
		})
	default:
		w.WriteHeader(http.StatusNotFound)
	}
}

// The DescribeInstances response, element names as in the EC2 API reference.
type (
	xmlTag struct {
		Key   string `xml:"key"`
		Value string `xml:"value"`
	}
	xmlPrivateIP struct {
		PrivateIPAddress string `xml:"privateIpAddress"`
		Primary          bool   `xml:"primary"`
	}
	xmlNIC struct {
		NetworkInterfaceID string         `xml:"networkInterfaceId"`
		PrivateIPAddress   string         `xml:"privateIpAddress"`
		PrivateIPs         []xmlPrivateIP `xml:"privateIpAddressesSet>item"`
	}
	xmlInstance struct {
		InstanceID       string   `xml:"instanceId"`
		ImageID          string   `xml:"imageId"`
		StateCode        int      `xml:"instanceState>code"`
		StateName        string   `xml:"instanceState>name"`
		PrivateDNSName   string   `xml:"privateDnsName"`
		InstanceType     string   `xml:"instanceType"`
		AvailabilityZone string   `xml:"placement>availabilityZone"`
		PrivateIPAddress string   `xml:"privateIpAddress"`
		NICs             []xmlNIC `xml:"networkInterfaceSet>item"`
		Tags             []xmlTag `xml:"tagSet>item"`
	}
	xmlReservation struct {
		ReservationID string        `xml:"reservationId"`
		OwnerID       string        `xml:"ownerId"`
		Instances     []xmlInstance `xml:"instancesSet>item"`
	}
	xmlDescribe struct {
		XMLName      xml.Name         `xml:"http://ec2.amazonaws.com/doc/2016-11-15/ DescribeInstancesResponse"`
		RequestID    string           `xml:"requestId"`
		Reservations []xmlReservation `xml:"reservationSet>item"`
		NextToken    string           `xml:"nextToken,omitempty"`
	}
	xmlError struct {
		XMLName   xml.Name `xml:"Response"`
		Code      string   `xml:"Errors>Error>Code"`
		Message   string   `xml:"Errors>Error>Message"`
		RequestID string   `xml:"RequestID"`
	}
)

func render(in Instance) xmlInstance {
	x := xmlInstance{
		InstanceID: in.ID, ImageID: "ami-0a1b2c3d4e5f67890", StateName: in.State, PrivateDNSName: in.DNS,
		InstanceType: "m6i.large", AvailabilityZone: Region + "a", PrivateIPAddress: in.IPs[0],
	}
	x.StateCode = map[string]int{"pending": 0, "running": 16, "stopping": 64, "stopped": 80}[in.State]
	nic := xmlNIC{NetworkInterfaceID: "eni-0" + in.ID[2:], PrivateIPAddress: in.IPs[0]}
	for i, ip := range in.IPs {
		nic.PrivateIPs = append(nic.PrivateIPs, xmlPrivateIP{ip, i == 0})
	}
	x.NICs = []xmlNIC{nic}
	keys := make([]string, 0, len(in.Tags))
	for k := range in.Tags {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		x.Tags = append(x.Tags, xmlTag{k, in.Tags[k]})
	}
	return x
}

func writeXML(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "text/xml;charset=UTF-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(xml.Header))
	_ = xml.NewEncoder(w).Encode(v)
}

func (f *Fake) serveEC2(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	auth := r.Header.Get("Authorization")
	if !strings.HasPrefix(auth, "AWS4-HMAC-SHA256 Credential="+AccessKeyID+"/") || !strings.Contains(auth, "/"+Region+"/ec2/aws4_request") {
		writeXML(w, http.StatusUnauthorized, xmlError{Code: "AuthFailure", Message: "AWS was not able to validate the provided access credentials", RequestID: "r1"})
		return
	}
	if err := r.ParseForm(); err != nil || r.PostForm.Get("Action") != "DescribeInstances" || r.PostForm.Get("Version") != "2016-11-15" {
		writeXML(w, http.StatusBadRequest, xmlError{Code: "InvalidAction", Message: "The action is not valid for this web service.", RequestID: "r2"})
		return
	}
	switch f.EC2Error {
	case "":
	case "RequestLimitExceeded", "Throttling":
		writeXML(w, http.StatusServiceUnavailable, xmlError{Code: f.EC2Error, Message: "Request limit exceeded.", RequestID: "r3"})
		return
	default:
		writeXML(w, http.StatusBadRequest, xmlError{Code: f.EC2Error, Message: "The instance ID does not exist", RequestID: "r4"})
		return
	}
	f.Describes++
	form := r.PostForm
	ids := map[string]bool{}
	filters := map[string][]string{}
	for i := 1; ; i++ {
		id := form.Get("InstanceId." + strconv.Itoa(i))
		name := form.Get("Filter." + strconv.Itoa(i) + ".Name")
		if id == "" && name == "" {
			break
		}
		if id != "" {
			ids[id] = true
		}
		for j := 1; name != ""; j++ {
			v := form.Get(fmt.Sprintf("Filter.%d.Value.%d", i, j))
			if v == "" {
				break
			}
			filters[name] = append(filters[name], v)
		}
	}
	f.LastFilters = filters
	var match []Instance
	for _, in := range f.Instances {
		ok := len(ids) == 0 || ids[in.ID]
		for name, values := range filters {
			switch {
			case name == "instance-state-name":
				ok = ok && slices.Contains(values, in.State)
			case strings.HasPrefix(name, "tag:"):
				ok = ok && slices.Contains(values, in.Tags[strings.TrimPrefix(name, "tag:")])
			}
		}
		if ok {
			match = append(match, in)
		}
	}
	start, _ := strconv.Atoi(form.Get("NextToken"))
	end := min(start+f.PageSize, len(match))
	resp := xmlDescribe{RequestID: "8f7724cf-496f-496e-8fe3-3b5e2f4a0001"}
	for _, in := range match[start:end] {
		resp.Reservations = append(resp.Reservations, xmlReservation{ReservationID: "r-0" + in.ID[2:], OwnerID: "123456789012", Instances: []xmlInstance{render(in)}})
	}
	if end < len(match) {
		resp.NextToken = strconv.Itoa(end)
	}
	writeXML(w, http.StatusOK, resp)
}
