package statedisk

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The fscrypt v2 ioctls (Documentation/filesystems/fscrypt.rst in the kernel tree). Each takes a
// file descriptor of any directory on the file system; keys are per file system (super block).

// keyID is an fscrypt v2 master key identifier: derived from the key by the kernel, not secret.
type keyID [unix.FSCRYPT_KEY_IDENTIFIER_SIZE]byte

func openDir(dir string) (int, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("opening %s: %w", dir, err)
	}
	return fd, nil
}

// closeFD closes a directory opened read-only for an ioctl: nothing is lost if that fails.
func closeFD(fd int) { _ = unix.Close(fd) }

func ioctl(fd int, req uint, arg unsafe.Pointer) error {
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(arg)); errno != 0 {
		return errno
	}
	return nil
}

// addKey adds an fscrypt master key to the file system of dir and returns its identifier.
func addKey(dir string, key []byte) (keyID, error) {
	fd, err := openDir(dir)
	if err != nil {
		return keyID{}, err
	}
	defer closeFD(fd)
	// struct fscrypt_add_key_arg is followed by the raw key (a flexible array member), so the
	// argument is built in one buffer that is zeroed afterwards.
	argSize := int(unsafe.Sizeof(unix.FscryptAddKeyArg{}))
	buf := make([]byte, argSize+len(key))
	defer clear(buf)
	arg := (*unix.FscryptAddKeyArg)(unsafe.Pointer(&buf[0]))
	arg.Key_spec.Type = unix.FSCRYPT_KEY_SPEC_TYPE_IDENTIFIER
	arg.Raw_size = uint32(len(key))
	copy(buf[argSize:], key)
	err = ioctl(fd, unix.FS_IOC_ADD_ENCRYPTION_KEY, unsafe.Pointer(&buf[0]))
	runtime.KeepAlive(buf)
	if err != nil {
		return keyID{}, fmt.Errorf("adding fscrypt key: %w", err)
	}
	var id keyID
	copy(id[:], arg.Key_spec.U[:len(id)])
	return id, nil
}

// removeKey removes the key id from the file system of dir. It reports whether files that still
// use the key were open (the kernel then forgets the key once they are closed). A key that is not
// there is not an error.
func removeKey(dir string, id keyID) (busy bool, err error) {
	fd, err := openDir(dir)
	if err != nil {
		return false, err
	}
	defer closeFD(fd)
	var arg unix.FscryptRemoveKeyArg
	arg.Key_spec.Type = unix.FSCRYPT_KEY_SPEC_TYPE_IDENTIFIER
	copy(arg.Key_spec.U[:], id[:])
	if err := ioctl(fd, unix.FS_IOC_REMOVE_ENCRYPTION_KEY, unsafe.Pointer(&arg)); err != nil {
		if errors.Is(err, unix.ENOKEY) {
			return false, nil
		}
		return false, fmt.Errorf("removing fscrypt key: %w", err)
	}
	return arg.Removal_status_flags&unix.FSCRYPT_KEY_REMOVAL_STATUS_FLAG_FILES_BUSY != 0, nil
}

// keyPresent reports whether the key id is present on the file system of dir.
func keyPresent(dir string, id keyID) (bool, error) {
	fd, err := openDir(dir)
	if err != nil {
		return false, err
	}
	defer closeFD(fd)
	var arg unix.FscryptGetKeyStatusArg
	arg.Key_spec.Type = unix.FSCRYPT_KEY_SPEC_TYPE_IDENTIFIER
	copy(arg.Key_spec.U[:], id[:])
	if err := ioctl(fd, unix.FS_IOC_GET_ENCRYPTION_KEY_STATUS, unsafe.Pointer(&arg)); err != nil {
		return false, fmt.Errorf("getting fscrypt key status: %w", err)
	}
	return arg.Status == unix.FSCRYPT_KEY_STATUS_PRESENT, nil
}

// setPolicy makes the empty directory dir an fscrypt v2 directory under the key id: AES-256-XTS
// for contents, AES-256-CTS for names, names padded to 32 bytes.
func setPolicy(dir string, id keyID) error {
	fd, err := openDir(dir)
	if err != nil {
		return err
	}
	defer closeFD(fd)
	policy := unix.FscryptPolicyV2{
		Version:                   unix.FSCRYPT_POLICY_V2,
		Contents_encryption_mode:  unix.FSCRYPT_MODE_AES_256_XTS,
		Filenames_encryption_mode: unix.FSCRYPT_MODE_AES_256_CTS,
		Flags:                     unix.FSCRYPT_POLICY_FLAGS_PAD_32,
		Master_key_identifier:     id,
	}
	if err := ioctl(fd, unix.FS_IOC_SET_ENCRYPTION_POLICY, unsafe.Pointer(&policy)); err != nil {
		return fmt.Errorf("setting fscrypt policy on %s: %w", dir, err)
	}
	return nil
}

// policyKey returns the master key identifier of dir's fscrypt v2 policy (readable without the
// key).
func policyKey(dir string) (keyID, error) {
	fd, err := openDir(dir)
	if err != nil {
		return keyID{}, err
	}
	defer closeFD(fd)
	var arg unix.FscryptGetPolicyExArg
	arg.Size = uint64(unsafe.Sizeof(unix.FscryptPolicyV2{}))
	if err := ioctl(fd, unix.FS_IOC_GET_ENCRYPTION_POLICY_EX, unsafe.Pointer(&arg)); err != nil {
		return keyID{}, fmt.Errorf("getting fscrypt policy of %s: %w", dir, err)
	}
	policy := (*unix.FscryptPolicyV2)(unsafe.Pointer(&arg.Policy[0]))
	if policy.Version != unix.FSCRYPT_POLICY_V2 {
		return keyID{}, fmt.Errorf("getting fscrypt policy of %s: version %d, want %d", dir, policy.Version, unix.FSCRYPT_POLICY_V2)
	}
	return policy.Master_key_identifier, nil
}
