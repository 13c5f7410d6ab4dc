// Package attack is Berth's malicious-peer suite: Go tests that attack the real binaries on loopback
// the way a peer on the network can, and check that each attack is refused for the reason it must be.
// It holds no code of its own besides this description; `make test` runs it (`go test ./attack/`),
// the flood harness behind must-show 1 of issue 20 runs with `make attack-flood`.
//
// The joinservice under attack is the real binary, attesting with swtpm, against a real kube-apiserver
// and etcd (internal/apiservertest), with a cluster policy that expects the genuine image (PCR 4) and a
// fresh node (PCR 15 zero) and trusts one EK CA. Attackers are software TPMs (vtpmtest.SoftTPM) at
// loopback addresses that metadata lists as the cluster's workers, so that every refusal comes from
// the check under test and not from an unknown address. The InitServer under attack is the real
// bootstrapper binary on swtpm.
//
//	attack                                   refused with             because
//	joinservice (TestJoinServiceUnderAttack)
//	replayed evidence                        NONCE_MISMATCH           the document binds the nonce of another handshake
//	transplanted evidence                    KEY_BINDING              the document binds another TLS key than the one in use
//	EK from an untrusted manufacturer        UNTRUSTED_ROOT           nothing vouches that the key lives in a TPM
//	garbage document                         MALFORMED_EVIDENCE       it proves nothing; the service stays up
//	oversized document (300 KB)              handshake refused        bounded before parsing; the service stays up
//	claims that lie (genuine claims,         MEASUREMENT_MISMATCH     claims never admit: the verified quote is judged
//	  tampered quote)                          on the verified quote
//	forged CSR (another node's name,         ticket for the attested  the certificate says only what was attested
//	  system:masters, extra SANs)              name only
//	CSR that does not parse                  BAD_CSR                  nothing to certify (its signature buys nothing)
//	no attestation (plaintext, plain TLS)    no ticket                a ticket is bound to an attested machine
//	attested TLS without a client            NO_EVIDENCE; admin:      only the admin RPCs serve a peer that attests
//	  certificate (join, rejoin, check-in,     ADMIN_PROOF_MISMATCH     nothing, and they want the master secret's
//	  an admin credential, wrong secret)                                proof
//	another node's role                      ROLE_MISMATCH            the role comes from metadata, not the node
//	an address metadata does not know        UNKNOWN_PEER             the identity comes from metadata
//	another node's disk (rejoin)             DISK_NOT_BOUND           the disk key goes only to the machine the disk
//	                                                                    is bound to
//	another machine's disk UUID (join)       a key for nothing        the disk key names the asking machine: it
//	                                           (differs from the        opens nothing of the disk's owner, its
//	                                           owner's), in the         binding gets only that key on rejoin
//	                                           ledger with the UUID
//	a thousand idle connections              genuine joins succeed    a peer cannot hold the service's handshakes
//	claims probing the policy (one random    one identical verdict    claims are judged as a whole and the verdict
//	  value per index, an index left out)                               names nothing: which indices are enforced
//	                                                                    stays unknown
//	ten nodes behind one address             all join; an answered    a probe and its handshake are one attempt: the
//	  (activating the joinservice's key),      probe's handshake        probe's credit pays the handshake
//	  their probes spending its tokens         goes through
//	malformed policy update                  PolicyRejected Event     the policy in force stays; joins go on
//	a flood of identity probes with random   refusals; genuine joins  probes cost no TPM work and draw from a budget
//	  claims from 500 addresses                succeed                  of their own; known addresses have their own
//	  (TestFloodKeepsGenuineJoins, 8 s;                                 attested budget; the ledger keeps the evidence
//	  make attack-flood, 30 s)                                          from before the flood; known
//	                                                                    peers' probes have their own
//	                                                                    budget: joins with the image's
//	                                                                    policy (probe, activation)
//	                                                                    succeed too
//	500 attested strangers (trusted EKs,     UNKNOWN_PEER,            only a call that passes every
//	  any image) at unknown addresses,         MEASUREMENT_MISMATCH,    cheap check spends the tickets
//	  5 calls/s each, spread out               RATE_LIMITED; 20 of 20   budget; refusals have budgets
//	  (TestAttestedStrangersLeaveTickets)      genuine joins succeed    of their own
//	250 addresses sending garbage            NOT_ACTIVATED,           refusals that cost no verified
//	  certificates or untrusted EKs            UNTRUSTED_ROOT, kept     TPM operation are unverified:
//	  (TestGarbageLeavesLedgerEvidence)        apart                    the replay and transplant
//	                                                                    before them stay in the ledger
//	InitServer (TestInitServerUnderAttack)
//	1,000 wrong init secrets, one connection PERMISSION_DENIED or     one generic answer that says nothing; at most
//	                                           RESOURCE_EXHAUSTED       the burst plus one a second reach the check
//	50 concurrent inits, 50 addresses        one runs, the others     the node is initialized once, for one cluster
//	                                           BUSY or CLUSTER_MISMATCH
//	init of a node metadata calls a worker   NOT_CONTROL_PLANE        the node stays fresh and can still join
//	boot stage (TestBootStageRefusesForeignDisk; a node's fscrypt state disk on swtpm, rejoining
//	  against the joinservice above)
//	state disk header rewritten with         the disk closed again,   the header's MAC under the disk key does not
//	  another cluster ID                       lock register not        verify; the rejoin ticket is for the real
//	                                           extended, disk kept      cluster, not the header's
//	another node's state disk swapped in     the same                 its sealed key does not load in this TPM;
//	  (foreign header and sealed blob)                                  its binding is the other machine's
//	                                                                    (DISK_NOT_BOUND)
//	join client (TestWorkerPosingAsJoinService)
//	a bootstrapped worker's TPM serving the  JOINSERVICE_NOT_BOUND    only a control plane's lock register holds the
//	  join protocol to a fresh node with                                control plane's value for the cluster; a
//	  the image's policy (no AK CA)                                     worker's extend cannot reach it
//	wrong init secrets from 12 addresses     PERMISSION_DENIED or     wrong secrets draw from a budget
//	  at full speed                            RESOURCE_EXHAUSTED;      of their own: 3 of 3 berth init
//	  (TestInitThroughWrongSecretFlood)        berth init runs          runs reach init
//	identity probes from 500 addresses       rate-limited past the    berth init connects (dialing
//	  (TestInitThroughProbeFlood)              unauthenticated budget   again while refused) and
//	                                                                    starts init
//	recovery server (the real bootstrapper waiting for berth recover: fscrypt state disk on swtpm, no
//	  sealed key, no joinservice answering)
//	2,000 wrong-key Recover calls over 8     RESOURCE_EXHAUSTED at    Recover calls are bounded per peer address
//	  attested connections from 8 addresses    once, but one per        (one waiting or running, one a second): the
//	  (TestRecoverThroughWrongKeyFlood)        address; berth recover   operator's key waits for at most one open
//	                                           succeeds                 per flooding address
//	identity probes from 500 addresses       rate-limited past the    probes draw from the unauthenticated
//	  (TestRecoverThroughProbeFlood)           unauthenticated budget;  budget, never from the attested one
//	                                           berth recover succeeds   berth recover needs
//	berth CLI (TestOperatorReadsNoImpostorText)
//	an impostor's verdict on claims, rate    a reason code, or the    nothing an unauthenticated peer sends reaches
//	  limit refusal and variant name, made     words quoted and         the operator's terminal verbatim; a client
//	  of escape sequences and fake output      escaped                  without claims takes no claims verdict
//
// Each test names in its comments why the attack must fail; TestJoinServiceUnderAttack also checks that
// a genuine node still joins after every attack.
package attack
