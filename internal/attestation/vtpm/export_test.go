package vtpm

import "time"

// SetClock makes v judge certificate validity at now() (tests of the identity cache's expiry).
func SetClock(v *Validator, now func() time.Time) { v.now = now }

// LimitIdentities lowers how many identities v remembers.
func LimitIdentities(v *Validator, n int) { v.maxIdentities = n }

// RememberedIdentities is how many identities v remembers.
func RememberedIdentities(v *Validator) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.identities)
}
